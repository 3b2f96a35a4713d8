"""numba's compiler for the index's per-block loops (index/paired_update.py, index/mask_table.py).

Compiled code is cached on disk beside the modules (or in numba's user cache folder), so only a fresh
checkout's first process compiles (1.6-2.6 s of CPU); later ones load it (0.27-0.41 s). Where no cache folder can be
written (a read-only install without a writable home), numba refuses to cache: the loops are then compiled in
every process instead of failing its start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba


def compiled(function: Callable[..., Any], *, nogil: bool = False) -> Callable[..., Any]:
    """``numba.njit`` with its disk cache where one can be written."""
    try:
        return numba.njit(cache=True, nogil=nogil)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(nogil=nogil)(function)


def compiled_without_gil(function: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, releasing the GIL while it runs: for a loop a worker thread runs beside the event loop."""
    return compiled(function, nogil=True)
