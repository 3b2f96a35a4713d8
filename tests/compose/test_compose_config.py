"""The docker compose cluster cannot run here, so check what can be checked: the compose file resolves
for both profiles, the HAProxy config it ships is valid and generated from the cluster's template, and
the Grafana dashboard parses and queries only metrics that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster import haproxy
from gateway.metrics import RouterMetrics
from mesh.auth import load_secret

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
ALWAYS = {"router", "haproxy", "redis", "prometheus", "grafana"}
ENGINE_METRICS = {
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_bucket",
}  # fmt: skip


def _compose_config(profile: str) -> dict:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose missing: run scripts/system_deps.sh")
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE / "docker-compose.yml"), "--profile", profile, "config"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_sim_profile_resolves_with_cpu_engines() -> None:
    config = _compose_config("sim")
    services = config["services"]
    assert ALWAYS | {"sim-engine-1", "sim-engine-2"} <= set(services)
    for name, alias in (("sim-engine-1", "engine-1"), ("sim-engine-2", "engine-2")):
        assert services[name]["profiles"] == ["sim"]
        assert alias in services[name]["networks"]["default"]["aliases"]
    router = services["router"]["command"]
    assert "--engine=http://engine-1:8000" in router and "--redis-url=redis://redis:6379/0" in router


def test_gpu_profile_runs_vllm_with_kv_events_and_gpus() -> None:
    services = _compose_config("gpu")["services"]
    for name in ("vllm-engine-1", "vllm-engine-2"):
        engine = services[name]
        assert engine["image"].startswith("vllm/vllm-openai")
        assert engine["profiles"] == ["gpu"]
        args = engine["command"]
        events = json.loads(args[args.index("--kv-events-config") + 1])
        assert events["enable_kv_cache_events"] is True and events["replay_endpoint"].startswith("tcp://*:")
        devices = engine["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_shipped_haproxy_config_is_valid_and_from_the_template(tmp_path: Path) -> None:
    shipped = (COMPOSE / "haproxy.cfg").read_text()
    assert shipped == haproxy.render("*:8080", "*:8404", dns="router:8000", origin="compose")
    assert "server-template router 1-16 router:8000 check resolvers docker init-addr none" in shipped
    # haproxy -c resolves nothing at check time thanks to init-addr none, so the file checks offline.
    config = tmp_path / "haproxy.cfg"
    config.write_text(shipped)
    haproxy.check(config)


def _router_metric_names() -> set[str]:
    """Every sample name the router's /metrics can expose (gateway/metrics.py is its only registry)."""
    names = set()
    for family in text_string_to_metric_families(RouterMetrics().render().decode()):
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "kvmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:kvmesh_|vllm:)[a-z_:]+", e)}
    assert any(m.startswith("kvmesh_") for m in used)
    unknown = used - _router_metric_names() - ENGINE_METRICS
    assert not unknown, f"dashboard queries metrics nobody exports: {sorted(unknown)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit rate", "ttft", "per engine", "replica", "health"):
        assert topic in titles


def test_prometheus_scrapes_routers_by_dns_and_both_engines() -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["kvmesh-router"]["dns_sd_configs"][0]["names"] == ["router"]
    assert jobs["engines"]["static_configs"][0]["targets"] == ["engine-1:8000", "engine-2:8000"]


def test_the_mesh_secret_is_generated_at_first_start_never_taken_from_the_repository(tmp_path, monkeypatch) -> None:
    """Every replica reads one secret from the mesh-secret volume, written once by the mesh-secret service
    before any router starts; the generator's script, run here, writes a secret load_secret accepts and
    keeps an existing one."""
    services = _compose_config("sim")["services"]
    router, generator = services["router"], services["mesh-secret"]
    assert "--mesh-secret-file=/run/kvmesh/mesh.secret" in router["command"]
    assert router["depends_on"]["mesh-secret"]["condition"] == "service_completed_successfully"
    assert "mesh-secret:/run/kvmesh:ro" in router["volumes"] and "secrets" not in router
    assert not list(COMPOSE.glob("mesh.secret*"))
    script = generator["command"][0].replace("/run/kvmesh/mesh.secret", str(tmp_path / "mesh.secret"))
    monkeypatch.setattr("os.chown", lambda *args: None)
    exec(script, {})
    first = load_secret(tmp_path / "mesh.secret")
    assert len(first) == 64 and int(first, 16) >= 0
    exec(script, {})
    assert load_secret(tmp_path / "mesh.secret") == first
