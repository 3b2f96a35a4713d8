"""Session fixtures for the real-vLLM tests: install once, start two shared engines once.

A third engine with a 24-block cache (for eviction and restart tests) starts only when a test asks for
it. At most three engines exist at a time (~7.3 GB); every one is stopped when the session ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from transformers import PreTrainedTokenizerBase
from vllm_wire import EventTap

from cluster.vllm_engine import EngineOptions, VllmEngine, install, vllm_engines
from tokenization.registry import load_tokenizer

TINY_CACHE_BLOCKS = 24
ROUTER_TOKENIZER = Path(__file__).resolve().parents[2] / "tokenization" / "default"


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    return install()


@pytest.fixture(scope="session")
def engines(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmEngine]]:
    options = EngineOptions(model=vllm_model, log_dir=tmp_path_factory.mktemp("vllm-logs"))
    with vllm_engines(2, options) as started:
        yield started


@pytest.fixture(scope="session")
def tiny_engine(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    options = EngineOptions(
        model=vllm_model, num_gpu_blocks=TINY_CACHE_BLOCKS, log_dir=tmp_path_factory.mktemp("vllm-tiny-logs")
    )
    with vllm_engines(1, options, prefix="vllm-tiny") as [engine]:
        yield engine


@pytest.fixture(scope="session")
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@pytest.fixture(scope="session")
def taps(engines: list[VllmEngine], zmq_context: zmq.Context) -> Iterator[list[EventTap]]:
    opened = [EventTap(engine, zmq_context).open() for engine in engines]
    yield opened
    for tap in opened:
        tap.close()


@pytest.fixture(scope="session")
def tiny_tap(tiny_engine: VllmEngine, zmq_context: zmq.Context) -> Iterator[EventTap]:
    tap = EventTap(tiny_engine, zmq_context).open()
    yield tap
    tap.close()


@pytest.fixture(scope="session")
def router_tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(str(ROUTER_TOKENIZER))
