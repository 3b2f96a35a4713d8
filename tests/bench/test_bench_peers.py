"""Peer routers named in a policy list: how smg is found and started."""

from __future__ import annotations

import pytest

from bench import peers
from bench.processes import StartFailed


def test_smg_policies_are_peers_and_start_on_loopback_with_their_own_metrics_port():
    assert peers.is_peer("smg:cache_aware") and not peers.is_peer("kv_aware")
    argv = peers.smg_argv("/opt/smg", "smg:cache_aware", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 7000, 7001)
    assert argv[:2] == ["/opt/smg", "launch"]
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert (argv[argv.index("--port") + 1], argv[argv.index("--prometheus-port") + 1]) == ("7000", "7001")
    assert argv[argv.index("--host") + 1] == argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"


def test_a_missing_smg_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv("SMG_BINARY", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(StartFailed, match="pip install smg"):
        peers.smg_binary()
    monkeypatch.setenv("SMG_BINARY", "/somewhere/smg")
    assert peers.smg_binary() == "/somewhere/smg"
