"""``kvmesh bench decide``: a pass reads its figure, and runs this harness on another tree's routing code."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from bench.decide_cost import _MEDIAN, pass_command
from bench.processes import REPO_ROOT
from bench.revision import pass_in


def test_a_pass_runs_this_harness_with_the_routing_code_of_its_tree(tmp_path: Path):
    tree = tmp_path / "tree"
    shutil.copytree(REPO_ROOT / "gateway", tree / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("index", "events", "tokenization"):
        shutil.copytree(REPO_ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "default"))
    assert 0 < pass_in(tree, pass_command(2), _MEDIAN) < 1e3
    marker = tree / "gateway" / "routing" / "kv_aware.py"
    marker.write_text(marker.read_text() + "\nraise SystemExit('the tree was imported')\n")
    with pytest.raises(subprocess.CalledProcessError):  # its routing code came from the tree, not this checkout
        pass_in(tree, pass_command(2), _MEDIAN)
