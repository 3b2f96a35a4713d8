"""The official openai client, unmodified, against the router."""

import openai
import pytest
from gateway_http import MODEL

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_models(api):
    assert [m.id for m in api.models.list()] == [MODEL]


def test_chat_and_completion(api):
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
    completion = api.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
    assert completion.choices[0].text and completion.usage.completion_tokens > 0


def test_streaming(api):
    stream = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "stream"}],
                                         max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_error_case(api):
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    assert "does not exist" in info.value.message
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=-3)
