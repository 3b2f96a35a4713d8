"""Chat media parts: identifiers sent as uuids, placeholders rendered as vLLM renders them, expansion."""

import pytest

from index.media_keys import MediaSpan
from sim.media import engine_items, expanded, parse_placeholder
from tokenization.media import ID_PREFIX, MediaItem, Placeholder, expand, with_uuids
from tokenization.messages import RenderError, conversation
from tokenization.registry import DEFAULT_TOKENIZER_DIR, load_tokenizer
from tokenization.render import prompt_token_ids_sync, render_chat

IMAGE = Placeholder(0, 5, "<|endoftext|>")
"""The tiny tokenizer's one spare special token stands in for a vision model's image token."""


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def body(*parts, text="what is this?"):
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def test_a_text_only_chat_is_returned_as_is():
    plain = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert with_uuids(plain) == (plain, ()) and with_uuids(plain)[0] is plain


def test_each_item_gets_its_contents_hash_and_a_clients_uuid_is_replaced_unless_the_part_has_no_content():
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    forged = {**image("http://x/b.png"), "uuid": "victim-image"}
    by_ref = {"type": "image_url", "image_url": None, "uuid": "cached-earlier"}
    out, items = with_uuids(body(image("http://x/a.png"), audio, forged, by_ref, image("data:image/png;base64,AAA")))
    parts = out["messages"][1]["content"]
    assert [p.get("uuid") for p in parts[:5]] == [i.identifier for i in items]
    assert [i.modality for i in items] == ["image", "audio", "image", "image", "image"]
    assert items[0].identifier.startswith(ID_PREFIX) and items[2].identifier != "victim-image"
    assert items[3].identifier == "cached-earlier"
    again, same = with_uuids(body(image("http://x/a.png"), text="other words"))
    assert same[0] == items[0] and items[0] != items[4]
    assert "uuid" not in body(image("http://x/a.png"))["messages"][1]["content"][0], "input never mutated"


def test_a_string_template_gets_one_placeholder_per_item_in_front_of_the_text_as_vllm_writes_it():
    tok = load_tokenizer(str(DEFAULT_TOKENIZER_DIR))
    text = render_chat(tok, body(image("a"), image("b")), {"image": IMAGE.text})
    assert "<|im_start|>user\n<|endoftext|>\n<|endoftext|>\nwhat is this?<|im_end|>" in text
    typed = render_chat(tok, body(image("a"), image("b"), text="<|endoftext|> left, right:"), {"image": IMAGE.text})
    assert "user\n<|endoftext|>\n<|endoftext|> left, right:" in typed, "placeholders the text holds count"
    with pytest.raises(RenderError, match="more"):
        render_chat(tok, body(image("a"), text="<|endoftext|><|endoftext|>"), {"image": IMAGE.text})
    with pytest.raises(RenderError, match="text only"):
        render_chat(tok, body(image("a")))


def test_expansion_gives_each_item_its_run_in_order_and_refuses_a_mismatch():
    items = (MediaItem("image", "a"), MediaItem("image", "b"))
    ids, spans = expand([7, 0, 8, 0, 9], items, {"image": IMAGE})
    assert ids == [7, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 9]
    assert spans == (MediaSpan("a", 1, 5), MediaSpan("b", 7, 5))
    assert expand([7, 0, 9], items, {"image": IMAGE}) is None
    assert expand([7, 0, 0, 0, 9], items, {"image": IMAGE}) is None
    assert expand([7, 0], (MediaItem("audio", "x"),), {"image": IMAGE}) is None


def test_the_engine_reads_the_routers_uuids_and_expands_the_prompt_the_router_predicts():
    tok = load_tokenizer(str(DEFAULT_TOKENIZER_DIR))
    forwarded, items = with_uuids(body(image("http://x/a.png"), image("http://x/b.png")))
    ids = prompt_token_ids_sync(tok, forwarded, "chat", {"image": IMAGE.text})
    predicted = expand(ids, items, {"image": IMAGE})
    assert predicted is not None and expanded(ids, forwarded, "m", {"image": IMAGE}) == predicted
    own = engine_items(body(image("http://x/a.png")), "m")
    assert own[0].identifier != items[0].identifier, "without a uuid the engine keys the item by its own hash"


def test_the_sims_placeholder_flag_is_checked():
    assert parse_placeholder("image=0:576") == ("image", 0, 576)
    for bad in ("video=1:2", "image=x:2", "image=1:0", "image=1"):
        with pytest.raises(ValueError):
            parse_placeholder(bad)


def test_a_template_that_loops_over_parts_gets_each_item_as_a_part_of_its_modality_in_place():
    messages = body(image("a"), {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}})["messages"]
    out = conversation(messages, "openai", {"image": "<i>", "audio": "<a>"})
    assert out[1]["content"] == [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "what is this?"}]
    assert conversation(messages, "string", {"image": "<i>", "audio": "<a>"})[1]["content"] == \
        "<i>\n<a>\nwhat is this?"
