"""CPU time of a daemonised process and its session (a router plus its tokenizer workers), from /proc."""

from __future__ import annotations

import os
from pathlib import Path

from cluster.daemon import ProcessRecord, session_members

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def session_cpu_seconds(record: ProcessRecord) -> float:
    """CPU of every live process in the record's session; a worker that exited meanwhile is not counted."""
    return sum(cpu_seconds(pid) for pid in session_members(record))
