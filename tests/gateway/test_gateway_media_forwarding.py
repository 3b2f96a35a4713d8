"""What the router forwards for chats with and without media, and what it keys (in process)."""

import json

import trio
from router_inprocess import MODEL, StubUpstream, call, make_router

from gateway.media_config import MediaPlaceholderConfig, MultimodalModelConfig
from gateway.route_planner import Media
from tokenization.media import MediaItem, Placeholder

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}, "uuid": "client-chosen"}
TEXT = {"type": "text", "text": " ".join(f"w{i}" for i in range(80))}


def chat(*parts) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [*parts]}]},
                      separators=(", ", ": ")).encode()


def routed(body: bytes, **config):
    upstream = StubUpstream()
    router = make_router(upstream, **config)
    answer = trio.run(call, router, "POST", "/v1/chat/completions", body)
    assert answer.status == 200, answer.body
    return upstream.calls[0].body, router


MEDIA = {"multimodal": {MODEL: MultimodalModelConfig(image=MediaPlaceholderConfig(token_id=0, tokens=32))}}


def test_text_only_chats_and_completions_are_forwarded_byte_for_byte():
    body = chat(TEXT)
    assert routed(body, **MEDIA)[0] == body
    completion = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()
    upstream = StubUpstream()
    router = make_router(upstream, **MEDIA)
    trio.run(call, router, "POST", "/v1/completions", completion)
    assert upstream.calls[0].body == completion


def test_an_image_chat_carries_the_routers_identifier_in_place_of_the_clients_and_is_tokenized():
    sent, router = routed(chat(IMAGE, TEXT), **MEDIA)
    part = json.loads(sent)["messages"][0]["content"][0]
    assert part["uuid"].startswith("kvmesh-") and part["image_url"] == IMAGE["image_url"]
    assert router.planner.tokenizers.calls == 1


def test_without_a_table_an_image_chat_is_routed_untokenized_and_forwarded_unchanged():
    body = chat(IMAGE, TEXT)
    sent, router = routed(body)
    assert sent == body and router.planner.tokenizers.calls == 0, "not refused as text-only, not keyed"


def test_a_placeholder_token_outside_the_vocabulary_leaves_image_chats_unkeyed_not_refused():
    bad = {"multimodal": {MODEL: MultimodalModelConfig(image=MediaPlaceholderConfig(token_id=10**6, tokens=32))}}
    _, router = routed(chat(IMAGE, TEXT), **bad)
    assert router.planner.tokenizers.calls == 0


def test_when_placeholders_and_items_disagree_only_the_prompt_before_the_first_placeholder_is_keyed():
    media = Media((MediaItem("image", "a"), MediaItem("image", "b")), {"image": Placeholder(0, 3, "<x>")})
    assert media.expanded([5, 6, 0, 7]) == [5, 6] and media.spans == ()
    assert media.expanded([5, 0, 0]) == [5, 0, 0, 0, 0, 0, 0] and [s.offset for s in media.spans] == [1, 4]
