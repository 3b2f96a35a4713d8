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
from gateway.config import load_config
from gateway.metrics import RouterMetrics
from gateway.security.auth import Authenticator
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


def test_secrets_are_generated_at_first_start_never_taken_from_the_repository(tmp_path, monkeypatch) -> None:
    """Every replica reads the mesh secret and a router config with auth on from the secrets volume, written
    once by the secrets service before any router starts. The generator's script, run here, writes a secret
    load_secret accepts, API keys whose hashes the config holds (a config the router loads, bound to
    0.0.0.0), and keeps all of it on a second run."""
    services = _compose_config("sim")["services"]
    router, generator = services["router"], services["secrets"]
    assert "--mesh-secret-file=/run/kvmesh/mesh.secret" in router["command"]
    assert "--config=/run/kvmesh/router.toml" in router["command"]
    assert router["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    assert "secrets:/run/kvmesh:ro" in router["volumes"]
    assert not list(COMPOSE.glob("mesh.secret*")) and not list(COMPOSE.glob("*.key"))
    script = generator["command"][0].replace('"/run/kvmesh"', repr(str(tmp_path)))
    monkeypatch.setattr("os.chown", lambda *args: None)
    exec(script, {})
    first = load_secret(tmp_path / "mesh.secret")
    assert len(first) == 64 and int(first, 16) >= 0
    config = load_config(tmp_path / "router.toml", cli={"host": "0.0.0.0"}, environ={})
    assert config.auth.enabled
    auth = Authenticator(config.auth, config.tenants)
    admin, client = ((tmp_path / name).read_text().strip() for name in ("admin.key", "client.key"))
    assert auth.is_admin(f"Bearer {admin}") and not auth.is_admin(f"Bearer {client}")
    assert auth.resolve(f"Bearer {client}") is not None
    exec(script, {})
    assert load_secret(tmp_path / "mesh.secret") == first
    assert (tmp_path / "client.key").read_text().strip() == client
