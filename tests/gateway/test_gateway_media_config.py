"""The ``[multimodal."<model>"]`` tables: read from the file or the environment, checked at start-up."""

import pytest

from gateway.config import ConfigError, load_config


def test_a_models_placeholder_is_read_and_its_text_defaults_to_the_tokens():
    config = load_config(environ={"KVMESH_MULTIMODAL__llava__IMAGE__TOKEN_ID": "32000",
                                  "KVMESH_MULTIMODAL__llava__IMAGE__TOKENS": "576"})
    placeholders = config.multimodal["llava"].placeholders(lambda token: f"<{token}>")
    assert (placeholders["image"].token_id, placeholders["image"].tokens, placeholders["image"].text) == \
        (32000, 576, "<32000>")
    assert "audio" not in placeholders


@pytest.mark.parametrize(("key", "value", "error"), [("TOKENS", "0", "tokens"), ("TOKEN_ID", "-1", "token_id"),
                                                     ("TEXT", "", "text")])
def test_a_bad_placeholder_names_its_key(key, value, error):
    environ = {"KVMESH_MULTIMODAL__m__IMAGE__TOKEN_ID": "1", "KVMESH_MULTIMODAL__m__IMAGE__TOKENS": "4",
               f"KVMESH_MULTIMODAL__m__IMAGE__{key}": value}
    with pytest.raises(ConfigError, match=f"multimodal.m.image.{error}"):
        load_config(environ=environ)
