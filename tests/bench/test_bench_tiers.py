"""``kvmesh bench tiers`` starts what it says: engines with a CPU tier, routers that price or ignore it."""

from bench.tiers import TieredFleetSpec, router_toml
from gateway.config import load_config


def test_the_two_routers_differ_only_in_seeing_the_tiers(tmp_path):
    engines = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    for tiers in (True, False):
        path = tmp_path / f"{tiers}.toml"
        path.write_text(router_toml(engines, tiers))
        config = load_config(path, environ={})
        assert [e.url for e in config.engines] == engines
        assert {e.tiers.enabled for e in config.engines} == {tiers}


def test_engines_get_their_cpu_tier():
    argv = TieredFleetSpec(2, "h100-70b", num_blocks=512, cpu_blocks=2048).argv(9000)
    assert argv[argv.index("--cpu-blocks") + 1] == "2048" and argv[argv.index("--num-blocks") + 1] == "512"
