"""The project's code at another git revision, exported once per run, so a benchmark can run that code's
router next to this one's: the before and after of a change measured in the same run, on the same engine
and the same machine load (CPU per request moved by 10-20% between blocks of one run on a shared machine;
the same code's ratio to itself is what stays put)."""

from __future__ import annotations

import io
import re
import subprocess
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
