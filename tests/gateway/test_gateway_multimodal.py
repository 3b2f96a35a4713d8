"""Through a router to simulated engines: a chat with an image goes to the engine holding that image and hits
its blocks there; the same words with another image do not."""

import os
import time

import pytest
from gateway_http import MODEL, Http

from cluster.router_process import RouterProcess
from cluster.sim_process import SimFleetProcess
from tokenization.media import with_uuids

pytestmark = pytest.mark.integration
IMAGE_TOKENS = 48
"""Tokens per image (the tiny tokenizer's spare special token, id 0, is the image placeholder)."""
QUESTION = " ".join(f"word-{i % 29}" for i in range(120))


def image_chat(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": QUESTION}]}]}


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def overlap(client: Http, body: dict, engine: str) -> int:
    table = client.json("POST", "/debug/route", body)[2]
    return next(c for c in table["candidates"] if c["engine"] == engine)["overlap_exact_tokens"]


@pytest.fixture(scope="module")
def fleet():
    env = {**os.environ, f"KVMESH_MULTIMODAL__{MODEL}__IMAGE__TOKEN_ID": "0",
           f"KVMESH_MULTIMODAL__{MODEL}__IMAGE__TOKENS": str(IMAGE_TOKENS)}
    with (SimFleetProcess(engines=2, profile="fast", mm_placeholder=f"image=0:{IMAGE_TOKENS}") as sims,
          RouterProcess(sims.urls, metrics_interval=0.2, env=env) as proc):
        yield Http(proc.url), [Http(url) for url in sims.urls], [u.removeprefix("http://") for u in sims.urls]


def test_a_chat_goes_to_the_engine_holding_its_image_and_hits_its_blocks_there(fleet):
    client, engines, names = fleet
    cat, dog = image_chat("https://example.com/cat.png"), image_chat("data:image/png;base64,ZG9n")
    for engine, body in zip(engines, (cat, dog), strict=True):  # what a router would have sent each engine
        assert engine.json("POST", "/v1/chat/completions", with_uuids(body)[0])[0] == 200
    assert wait_for(lambda: overlap(client, cat, names[0]) >= 128 and overlap(client, dog, names[1]) >= 128)
    assert overlap(client, cat, names[1]) == 0, "the other engine holds the same words after another image"
    for body, name in ((cat, names[0]), (dog, names[1]), (cat, names[0])):
        status, headers, answer = client.json("POST", "/v1/chat/completions", body)
        assert status == 200 and f"engine={name}" in headers["x-kvmesh-route"], headers
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128, "the engine counts a hit"
        assert answer["usage"]["prompt_tokens"] > IMAGE_TOKENS + 120


def test_the_same_words_with_a_new_image_are_no_hit_anywhere(fleet):
    client, _, names = fleet
    bird = image_chat("https://example.com/bird.png")
    assert all(overlap(client, bird, name) == 0 for name in names)
    status, _, answer = client.json("POST", "/v1/chat/completions", bird)
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
