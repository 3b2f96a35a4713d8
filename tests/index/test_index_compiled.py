"""The index's compiled loops: they still compile where numba cannot cache them, and load before they are needed."""

from __future__ import annotations

import ast
import subprocess
import sys

import numba
import pytest

from index import alias_words
from index import compiled as compiled_module


def test_a_refused_cache_falls_back_to_compiling_in_each_process(monkeypatch: pytest.MonkeyPatch) -> None:
    real = numba.njit

    def njit(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'double': no locator available for file")
        return real(*args, **kwargs)

    monkeypatch.setattr(compiled_module.numba, "njit", njit)

    def double(x: int) -> int:
        return 2 * x

    loop = compiled_module.compiled(double)
    assert loop(21) == 42
    assert isinstance(loop, numba.core.registry.CPUDispatcher)


def test_building_an_index_loads_every_compiled_loop_before_the_first_event_or_lookup() -> None:
    """A fresh process: once an index is built, each compiled loop has its machine code, so neither the first event
    nor the first long prompt's lookup pays numba's load (or, on a fresh checkout, its compile) on the request path.
    Warmed with a two-block chain, the lookup's walk was left out: it is compiled only for chains of 16 blocks on."""
    probe = (
        "from index import alias_words, mask_table, paired_update\n"
        "from index.prefix_index import PrefixIndex\n"
        "PrefixIndex()\n"
        "loops = [mask_table._walk_compiled, paired_update._store_loop, paired_update._remove_loop,\n"
        " paired_update._rebit_loop, alias_words.reinsert_live]\n"
        "print([len(loop.signatures) for loop in loops])\n"
    )
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert all(count > 0 for count in ast.literal_eval(printed.stdout.strip().splitlines()[-1]))


def test_building_a_key_ledger_loads_its_compiled_loops() -> None:
    """The ingest process's ledger (index/key_ledger.py): its first events do not pay numba's load either."""
    probe = (
        "from index import key_ledger, paired_update\n"
        "key_ledger.KeyLedger()\n"
        "print([len(loop.signatures) for loop in (key_ledger._put_loop, paired_update.pop_loop)])\n"
    )
    printed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert all(count > 0 for count in ast.literal_eval(printed.stdout.strip().splitlines()[-1]))


def test_the_alias_rebuild_a_worker_thread_runs_releases_the_gil() -> None:
    """events/index_room.py sweeps an engine's alias table in a worker thread while every engine's ingest waits: a
    loop that held the GIL took 5-60 ms of wall time beside a busy event loop, where alone it takes about one."""
    assert alias_words.reinsert_live.targetoptions.get("nogil") is True
