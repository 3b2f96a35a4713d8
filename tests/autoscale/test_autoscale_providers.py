"""Providers: the command provider with the shipped examples against fake tools, and the local one."""

import json
import os
import sys
from pathlib import Path

import pytest
import trio
from fake_tools import FAKE_DOCKER, FAKE_KUBECTL

from autoscale.offers import Offer
from autoscale.providers.base import ProviderError, ProvisionResult
from autoscale.providers.command import CommandProvider
from autoscale.providers.local import LocalProvider

EXAMPLES = Path(__file__).resolve().parents[2] / "autoscale" / "providers" / "examples"
OFFER = Offer("small", island="rack-a", capacity=4, provisioning_s=0)


def fake_tool(tmp_path: Path, monkeypatch, name: str, source: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(source.replace("/usr/bin/env python3", sys.executable, 1))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    state = tmp_path / "state.json"
    monkeypatch.setenv("FAKE_STATE", str(state))
    return state


async def provision(provider, offer=OFFER, term=1) -> ProvisionResult:
    results: list[ProvisionResult] = []
    async with trio.open_nursery() as nursery:
        provider.attach(nursery)
        provider.provision(offer, results.append, term)
    return results[0]


FAKE_ENV = ["FAKE_STATE", "KVMESH_K8S_TEMPLATE", "KVMESH_FENCE_FILE"]


async def test_docker_compose_example_against_a_fake_docker(tmp_path, monkeypatch):
    state = fake_tool(tmp_path, monkeypatch, "docker", FAKE_DOCKER)
    monkeypatch.setenv("KVMESH_FENCE_FILE", str(tmp_path / "term.json"))
    provider = CommandProvider([sys.executable, str(EXAMPLES / "docker_compose.py")], timeout_s=30,
                               env_names=FAKE_ENV)
    first, second = await provision(provider), await provision(provider)
    assert first.engine is not None and second.engine is not None, (first.error, second.error)
    assert first.engine.url == "http://127.0.0.1:32001" and first.engine.offer == "small"
    assert first.engine.island == "rack-a"
    assert {e.id for e in await provider.list(1)} == {first.engine.id, second.engine.id}
    await provider.terminate(first.engine.id, 2)
    assert [e.id for e in await provider.list(2)] == [second.engine.id]
    calls = json.loads(state.read_text())["calls"]
    assert ["rm", "-f", first.engine.id] in calls
    # a replica that lost the lease (term 1, after term 2 was seen) is refused before docker is called
    stale = await provision(provider, term=1)
    assert stale.engine is None and "stale lease term 1" in stale.error
    with pytest.raises(ProviderError, match="stale lease term"):
        await provider.terminate(second.engine.id, 1)
    assert json.loads(state.read_text())["calls"] == calls  # refused before docker was called


async def test_kubernetes_example_against_a_fake_kubectl(tmp_path, monkeypatch):
    fake_tool(tmp_path, monkeypatch, "kubectl", FAKE_KUBECTL)
    template = tmp_path / "pod.json"
    template.write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "{{name}}"},
                                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}))
    monkeypatch.setenv("KVMESH_K8S_TEMPLATE", str(template))
    provider = CommandProvider([sys.executable, str(EXAMPLES / "kubernetes.py")], timeout_s=30,
                               env_names=FAKE_ENV)
    result = await provision(provider, term=7)
    assert result.engine is not None, result.error
    assert result.engine.id == "kvmesh-engine-command-7-1" and result.engine.url == "http://10.1.0.1:8000"
    assert [(e.id, e.offer) for e in await provider.list(7)] == [("kvmesh-engine-command-7-1", "small")]
    # a pod of term 7 exists: a holder of term 6 may neither provision nor terminate
    stale = await provision(provider, term=6)
    assert stale.engine is None and "stale lease term 6" in stale.error
    with pytest.raises(ProviderError, match="stale lease term"):
        await provider.terminate(result.engine.id, 6)
    # after a restart (a new term), the next pod gets a new name rather than re-applying the first
    again = await provision(CommandProvider([sys.executable, str(EXAMPLES / "kubernetes.py")], timeout_s=30,
                                            env_names=FAKE_ENV), term=8)
    assert again.engine is not None and again.engine.id == "kvmesh-engine-command-8-1"
    await provider.terminate(result.engine.id, 8)
    assert [e.id for e in await provider.list(8)] == ["kvmesh-engine-command-8-1"]


@pytest.mark.parametrize("script, error", [
    ("print('not json')", "not JSON"),
    ("import sys; sys.exit(3)", "exited with 3"),
    ("print('{\"id\": \"x\", \"url\": \"ftp://x\"}')", "http(s) url"),
    ("print('[1]')", "JSON object"),
])
async def test_bad_provider_output_is_an_error_not_a_crash(tmp_path, script, error):
    tool = tmp_path / "tool.py"
    tool.write_text(script)
    result = await provision(CommandProvider([sys.executable, str(tool)], timeout_s=30))
    assert result.engine is None and error in result.error
    with pytest.raises(ProviderError):
        await CommandProvider([sys.executable, str(tool)], timeout_s=30).list(1)


@pytest.mark.parametrize("action", ["list", "terminate", "provision"])
async def test_deeply_nested_output_is_a_provider_error(tmp_path, action):
    """Before, json.loads raised RecursionError out of list and terminate (and so out of the router)."""
    tool = tmp_path / "tool.py"
    tool.write_text("print('{\"engines\": ' + '[' * 200000 + ']' * 200000 + '}')")
    provider = CommandProvider([sys.executable, str(tool)], timeout_s=30)
    if action == "provision":
        result = await provision(provider)
        assert result.engine is None and "not JSON" in result.error
        return
    with pytest.raises(ProviderError, match="not JSON"):
        await (provider.list(1) if action == "list" else provider.terminate("x", 1))


async def test_endless_output_is_cut_at_the_cap_not_read_to_the_end(tmp_path):
    """Before, all output was read before the 1 MiB check: an endless writer was only stopped by the timeout
    (and 200 MB of output took the router's RSS to 430 MiB)."""
    tool = tmp_path / "tool.py"
    tool.write_text("import sys\nwhile True:\n    sys.stdout.buffer.write(b'x' * 65536)\n")
    provider = CommandProvider([sys.executable, str(tool)], timeout_s=60)
    with trio.fail_after(30), pytest.raises(ProviderError, match="output larger than"):
        await provider.list(1)


async def test_the_child_gets_a_minimal_environment_and_its_stderr_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_API_KEYS", "sk-router-secret")
    monkeypatch.setenv("PROVIDER_TOKEN", "tok-0123456789")
    tool = tmp_path / "tool.py"
    tool.write_text("import os, sys\n"
                    "sys.stderr.write(os.environ.get('KVMESH_API_KEYS', 'no router key') + ' / '"
                    " + os.environ['PROVIDER_TOKEN'] + ' / password=hunter2 Bearer abc.def\\n')\n"
                    "sys.exit(2)\n")
    provider = CommandProvider([sys.executable, str(tool)], timeout_s=30, env_names=["PROVIDER_TOKEN"])
    with pytest.raises(ProviderError) as error:
        await provider.list(1)
    message = str(error.value)
    assert "no router key" in message and "sk-router-secret" not in message
    for secret in ("tok-0123456789", "hunter2", "abc.def"):
        assert secret not in message, message
    assert message.count("[redacted]") == 3


@pytest.mark.integration
async def test_local_provider_starts_and_stops_a_simulated_engine():
    provider = LocalProvider(["--profile", "fast"])
    async with trio.open_nursery() as nursery:
        provider.attach(nursery)
        ready: list[ProvisionResult] = []
        provider.provision(OFFER, ready.append, 1)
        with trio.fail_after(60):
            while not ready:
                await trio.sleep(0.05)
        engine = ready[0].engine
        assert engine is not None, ready[0].error
        stream = await trio.open_tcp_stream("127.0.0.1", int(engine.url.rsplit(":", 1)[1]))
        await stream.aclose()
        assert [e.id for e in await provider.list(1)] == [engine.id]
        await provider.terminate(engine.id, 1)
        assert await provider.list(1) == []
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", int(engine.url.rsplit(":", 1)[1]))


async def test_a_provider_bug_is_reported_as_a_failed_provision():
    class Broken(CommandProvider):
        async def _provision(self, request_id, offer, term):
            raise RuntimeError("boom")

    result = await provision(Broken(["unused"]))
    assert result.engine is None and "RuntimeError: boom" in result.error
