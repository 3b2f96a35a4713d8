"""The index's compiled loops still compile where numba cannot cache them."""

from __future__ import annotations

import numba
import pytest

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
