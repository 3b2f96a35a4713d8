"""The [autoscaler] table: parsed with the router's configuration, bad values named by key."""

import pytest

from gateway.config import ConfigError, load_config

GOOD = """
[autoscaler]
enabled = true
provider = "command"
command = ["./provider.sh"]
min_engines = 2
[[autoscaler.offers]]
name = "a40"
island = "rack-a"
price_per_hour = 1.2
capacity = 4
"""


def load(tmp_path, text: str, environ=None):
    path = tmp_path / "kvmesh.toml"
    path.write_text(text)
    return load_config(path, environ=environ or {})


def test_table_becomes_a_policy_and_offers(tmp_path):
    config = load(tmp_path, GOOD, {"KVMESH_AUTOSCALER__DRY_RUN": "true"}).autoscaler
    assert config.policy().min_engines == 2 and config.policy().dry_run
    assert config.offers[0].island == "rack-a" and config.offers[0].capacity == 4.0


@pytest.mark.parametrize("change, key", [
    (("provider = \"command\"", "provider = \"cloud\""), "autoscaler.provider"),
    (("command = [\"./provider.sh\"]", ""), "autoscaler.command"),
    (("min_engines = 2", "min_engines = 9"), "autoscaler.min_engines"),
    (("capacity = 4", "capacity = 0"), "autoscaler.offers[0].capacity"),
    (("capacity = 4", "capacity = \"big\""), "autoscaler.offers[0].capacity"),
])
def test_bad_values_name_their_key(tmp_path, change, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load(tmp_path, GOOD.replace(*change))


def test_disabled_table_is_not_checked(tmp_path):
    assert not load(tmp_path, "[autoscaler]\nprovider = \"cloud\"\n").autoscaler.enabled
