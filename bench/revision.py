"""The project's code at another git revision, exported once per run, so a benchmark can run that code's
router next to this one's: the before and after of a change measured in the same run, on the same engine
and the same machine load (CPU per request moved by 10-20% between blocks of one run on a shared machine;
the same code's ratio to itself is what stays put)."""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.processes import REPO_ROOT

REVISION_PEERS = ("kvmesh", "passthrough")
"""Paths that may run another revision's code: ``kvmesh@REV`` and ``passthrough@REV``."""
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/~^-]{0,99}")


def split_peer(name: str) -> tuple[str, str | None]:
    """``kvmesh@HEAD~1`` -> ("kvmesh", "HEAD~1"); a name without ``@`` has no revision."""
    base, at, revision = name.partition("@")
    return base, (revision if at else None)


def is_revision_peer(name: str) -> bool:
    base, revision = split_peer(name)
    return base in REVISION_PEERS and revision is not None and _REVISION.fullmatch(revision) is not None


def _inside_tree(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, leaving out what it refuses (a link leading outside the tree: some commits
    hold a worktree's link to a local virtualenv) instead of failing the whole export."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def exported(revision: str, into: Path, repo: Path = REPO_ROOT) -> Path:
    """The tree of ``revision`` (any name git resolves) under ``into``, exported once per commit; the
    directory a child process runs from (its cwd and import path)."""
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{revision}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    tree = into / f"rev-{commit[:12]}"
    if not (tree / ".exported").exists():
        archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit],
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tree, filter=_inside_tree)
        (tree / ".exported").write_text(commit)
    return tree


def pass_in(tree: Path | None, command: list[str], figure: re.Pattern[str]) -> float:
    """One pass of ``command`` (arguments to this Python) in a fresh process importing the code in ``tree``
    (this code's when None): the number ``figure`` finds in its output. A fresh process per pass for both
    codes, so neither inherits the other's heap."""
    root = tree or REPO_ROOT
    out = subprocess.run([sys.executable, *command], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                         capture_output=True, text=True, check=True).stdout
    found = figure.search(out)
    if found is None:
        raise SystemExit(f"no figure in a pass's output: {out[-300:]!r}")
    return float(found.group(1))


def side_by_side(against: str, passes: int, command: list[str], figure: re.Pattern[str], unit: str,
                 log_dir: Path) -> list[str]:
    """This code and revision ``against`` in alternating fresh processes (which goes first alternates too): on
    a machine whose load moves a single pass by up to 1.6x, the per-pair ratio and the medians are what a
    comparison can read. Prints both series and ``against``'s figure over this code's per pair."""
    tree = exported(against, log_dir)
    mine: list[float] = []
    theirs: list[float] = []
    for i in range(passes):
        order = ((mine, None), (theirs, tree)) if i % 2 == 0 else ((theirs, tree), (mine, None))
        for series, root in order:
            series.append(pass_in(root, command, figure))
    ratios = [t / m for m, t in zip(mine, theirs, strict=True)]
    return [f"this code     {unit}: {' '.join(f'{x:.2f}' for x in mine)} (median {statistics.median(mine):.2f})",
            f"{against:<13} {unit}: {' '.join(f'{x:.2f}' for x in theirs)} "
            f"(median {statistics.median(theirs):.2f})",
            f"{against} / this code per pair: {' '.join(f'{r:.3f}' for r in ratios)} "
            f"(median {statistics.median(ratios):.3f})"]


def add_against_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--against REV``, ``--passes`` and ``--log-dir`` of a benchmark that can run ``side_by_side``."""
    parser.add_argument("--against", metavar="REV",
                        help=f"also run git revision REV's {what}, alternating fresh processes with this code's, "
                             "and print both series and the per-pair ratios")
    parser.add_argument("--passes", type=int, default=5, help="with --against: passes of each code (default 5)")
    parser.add_argument("--log-dir", type=Path,
                        help="with --against: where the revision is exported (default: a new temporary folder)")
