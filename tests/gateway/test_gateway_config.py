"""Configuration: file, environment and flags merge in that order; bad keys are named."""

import pytest

from gateway.cli import parse_router_args
from gateway.config import ConfigError, load_config


def write(tmp_path, text):
    path = tmp_path / "kvmesh.toml"
    path.write_text(text)
    return path


def test_quick_start_without_file():
    config = parse_router_args(["--port", "8000", "--engine", "http://127.0.0.1:8100",
                                "--engine", "http://127.0.0.1:8101"])
    assert config.port == 8000
    assert [e.url for e in config.engines] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert config.policy == "kv_aware"


def test_file_env_and_flags_override_in_order(tmp_path):
    path = write(tmp_path, 'port = 9000\npolicy = "round_robin"\n[mesh]\nbind = "127.0.0.1:7946"\n'
                           '[[engines]]\nurl = "http://10.0.0.1:8000"\nmodel = "m"\nisland = "a"\n')
    config = load_config(path, environ={"KVMESH_PORT": "9001", "KVMESH_MESH__BIND": "127.0.0.1:7000"})
    assert config.port == 9001 and config.mesh.bind == "127.0.0.1:7000" and config.policy == "round_robin"
    config = load_config(path, cli={"port": 9002}, environ={"KVMESH_PORT": "9001"},
                         extra_engines=["http://10.0.0.2:8000", "http://10.0.0.1:8000"])
    assert config.port == 9002
    assert [e.url for e in config.engines] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert config.engines[0].island == "a"


@pytest.mark.parametrize(
    ("text", "environ", "key"),
    [
        ("prot = 1\n", {}, "prot"),
        ("port = 'x'\n", {}, "port"),
        ("[[engines]]\nurl = 'ftp://x'\n", {}, "engines[0].url"),
        ("[[engines]]\nurl = 'http://x:1'\nevents = 'udp://x'\n", {}, "engines[0].events"),
        ("[[engines]]\nurl = 'http://x:1'\ncolour = 1\n", {}, "engines[0].colour"),
        ("policy = 'fastest'\n", {}, "policy"),
        ("", {"KVMESH_MAX_ATTEMPTS": "zero"}, "max_attempts"),
        ("[mesh]\nredundancy = 0\n", {}, "mesh.redundancy"),
        ("[[engines]]\nmodel = 'm'\n", {}, "engines[0]"),
    ],
)
def test_bad_values_name_the_key(tmp_path, text, environ, key):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ=environ)
    assert str(info.value).startswith(key)


def test_env_engine_list():
    config = load_config(environ={"KVMESH_ENGINES": "http://a:1, http://b:2"})
    assert [e.url for e in config.engines] == ["http://a:1", "http://b:2"]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


ADMIN_HASH = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "refused"), [
    ('host = "0.0.0.0"\n', True),
    ('host = "10.1.2.3"\n', True),
    ('host = "127.0.0.1"\n', False),
    ('host = "::1"\n', False),
    ('host = "0.0.0.0"\n[auth]\nallow_open_network = true\n', False),
    (f'host = "0.0.0.0"\n[auth]\nenabled = true\nadmin_keys = ["{ADMIN_HASH}"]\n', False),
])
def test_auth_off_binds_only_loopback_unless_the_network_is_declared_trusted(tmp_path, text, refused):
    """With auth off everyone is admin: on an address others reach, that must be asked for by name."""
    if refused:
        with pytest.raises(ConfigError, match="allow_open_network"):
            load_config(write(tmp_path, text), environ={})
    else:
        load_config(write(tmp_path, text), environ={})


def test_curve_keys_are_checked_at_start(tmp_path):
    import zmq

    public, secret = (k.decode() for k in zmq.curve_keypair())
    engine = f'[[engines]]\nurl = "http://10.0.0.1:8000"\ncurve_server_key = "{public}"\n'
    with pytest.raises(ConfigError, match="^events_curve_secret_file"):
        load_config(write(tmp_path, engine), environ={})
    with pytest.raises(ConfigError, match=r"^engines\[0\].curve_server_key"):
        load_config(write(tmp_path, engine.replace(public, "not a key")), environ={})
    key_file = tmp_path / "router.curve"
    key_file.write_text("~" * 40)
    with pytest.raises(ConfigError, match="^events_curve_secret_file") as refused:
        load_config(write(tmp_path, f'events_curve_secret_file = "{key_file}"\n' + engine), environ={})
    assert "~" * 40 not in str(refused.value)
    key_file.write_text(secret + "\n")
    config = load_config(write(tmp_path, f'events_curve_secret_file = "{key_file}"\n' + engine), environ={})
    assert config.engines[0].curve_server_key == public
