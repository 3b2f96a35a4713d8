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


async def provision(provider, offer=OFFER) -> ProvisionResult:
    results: list[ProvisionResult] = []
    async with trio.open_nursery() as nursery:
        provider.attach(nursery)
        provider.provision(offer, results.append)
    return results[0]


async def test_docker_compose_example_against_a_fake_docker(tmp_path, monkeypatch):
    state = fake_tool(tmp_path, monkeypatch, "docker", FAKE_DOCKER)
    provider = CommandProvider([sys.executable, str(EXAMPLES / "docker_compose.py")], timeout_s=30)
    first, second = await provision(provider), await provision(provider)
    assert first.engine is not None and second.engine is not None, (first.error, second.error)
    assert first.engine.url == "http://127.0.0.1:32001" and first.engine.offer == "small"
    assert first.engine.island == "rack-a"
    assert {e.id for e in await provider.list()} == {first.engine.id, second.engine.id}
    await provider.terminate(first.engine.id)
    assert [e.id for e in await provider.list()] == [second.engine.id]
    calls = json.loads(state.read_text())["calls"]
    assert ["rm", "-f", first.engine.id] in calls


async def test_kubernetes_example_against_a_fake_kubectl(tmp_path, monkeypatch):
    fake_tool(tmp_path, monkeypatch, "kubectl", FAKE_KUBECTL)
    template = tmp_path / "pod.json"
    template.write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "{{name}}"},
                                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}))
    monkeypatch.setenv("KVMESH_K8S_TEMPLATE", str(template))
    provider = CommandProvider([sys.executable, str(EXAMPLES / "kubernetes.py")], timeout_s=30)
    result = await provision(provider)
    assert result.engine is not None, result.error
    assert result.engine.id == "kvmesh-engine-command-1" and result.engine.url == "http://10.1.0.1:8000"
    assert [(e.id, e.offer) for e in await provider.list()] == [("kvmesh-engine-command-1", "small")]
    await provider.terminate(result.engine.id)
    assert await provider.list() == []


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
        await CommandProvider([sys.executable, str(tool)], timeout_s=30).list()


@pytest.mark.integration
async def test_local_provider_starts_and_stops_a_simulated_engine():
    provider = LocalProvider(["--profile", "fast"])
    async with trio.open_nursery() as nursery:
        provider.attach(nursery)
        ready: list[ProvisionResult] = []
        provider.provision(OFFER, ready.append)
        with trio.fail_after(60):
            while not ready:
                await trio.sleep(0.05)
        engine = ready[0].engine
        assert engine is not None, ready[0].error
        stream = await trio.open_tcp_stream("127.0.0.1", int(engine.url.rsplit(":", 1)[1]))
        await stream.aclose()
        assert [e.id for e in await provider.list()] == [engine.id]
        await provider.terminate(engine.id)
        assert await provider.list() == []
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", int(engine.url.rsplit(":", 1)[1]))


async def test_a_provider_bug_is_reported_as_a_failed_provision():
    class Broken(CommandProvider):
        async def _provision(self, request_id, offer):
            raise RuntimeError("boom")

    result = await provision(Broken(["unused"]))
    assert result.engine is None and "RuntimeError: boom" in result.error
