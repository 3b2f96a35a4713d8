"""The trio launcher: a dying engine fails fast with its log, and cancellation leaves no process behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from cluster.vllm_engine import EngineFailed, EngineOptions, open_vllm_engines

pytestmark = pytest.mark.vllm


def processes_in(folder: Path) -> list[int]:
    """Engines run with their log folder as working directory: find them (and their children) by it."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == folder:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_an_engine_that_dies_fails_the_launch_with_its_log(vllm_model: Path, tmp_path: Path) -> None:
    options = EngineOptions(model=tmp_path / "no-such-model", log_dir=tmp_path)
    with pytest.raises(EngineFailed, match="exited with"):
        async with open_vllm_engines(1, options):
            pytest.fail("a missing model must not become healthy")
    assert not processes_in(tmp_path)


async def test_cancelling_a_launch_stops_the_whole_process_group(vllm_model: Path, tmp_path: Path) -> None:
    options = EngineOptions(model=vllm_model, num_gpu_blocks=24, log_dir=tmp_path)

    async def launch() -> None:
        async with open_vllm_engines(1, options):
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launch)
        # Cancel once the API server has spawned its EngineCore: both must go.
        with trio.fail_after(180):
            while len(processes_in(tmp_path)) < 2:
                await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    assert processes_in(tmp_path) == []
