"""Turn OpenAI chat messages into the conversation vLLM hands to the chat template.

Mirrors vLLM's ``parse_chat_messages`` for text-only models (vllm/entrypoints/chat_utils.py): which
message fields survive, how content parts are joined, how tool-call arguments are decoded. The router
must reproduce it byte for byte, because one stray newline changes every block hash after it.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

import jinja2.nodes
from transformers.utils.chat_template_utils import _compile_jinja_template

ContentFormat = Literal["string", "openai"]

TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
"""Content part types that carry text, and the key that holds it (vLLM's MM_PARSER_MAP text entries)."""
MEDIA_MODALITIES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio"}
"""Content part types that carry one image or audio item (``tokenization.media``)."""


class RenderError(ValueError):
    """A request the engine would reject with a 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """Look through filters, tests and slices, as vLLM does, to the expression being iterated."""
    while True:
        wrapped = isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None
        sliced = isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        if wrapped or sliced:
            node = node.node
        else:
            return node


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    node = _unwrap(node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return False


@lru_cache(maxsize=64)
def detect_content_format(chat_template: str) -> ContentFormat:
    """"openai" when the template loops over ``message['content']`` (it expects parts), else "string".

    vLLM detects this per template ("auto") and joins text parts with newlines for string templates.
    """
    try:
        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter):
            return "openai"
    return "string"


def _part_text(part: Any) -> str | None:
    """The text of one content part, None for a text part without text; errors for anything else."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise RenderError("Each content part must be a string or an object.", "messages")
    part_type = part.get("type")
    if part_type not in TEXT_PART_KEYS:
        raise RenderError(f"Unsupported chat content part type: {part_type!r} (this model takes text only).",
                          "messages")
    text = part.get(TEXT_PART_KEYS[part_type])
    if text is not None and not isinstance(text, str):
        raise RenderError(f"The {TEXT_PART_KEYS[part_type]!r} of a content part must be a string.", "messages")
    return text


def _media_modality(part: Any, placeholders: Mapping[str, str]) -> str | None:
    """The modality of a media part the model takes, None for any other part."""
    if not isinstance(part, dict) or part.get("type") not in MEDIA_MODALITIES:
        return None
    modality = MEDIA_MODALITIES[part["type"]]
    return modality if modality in placeholders else None


def _with_placeholders(found: list[str], text: str) -> str:
    """vLLM's ``_get_full_multimodal_text_prompt`` (interleaving off, its default): one placeholder per item
    in front of the text, grouped by placeholder, less those the text already holds."""
    counts = Counter(found)
    missing: list[str] = []
    for placeholder in counts:
        counts[placeholder] -= text.count(placeholder)
        if counts[placeholder] < 0:
            raise RenderError(f"Found more '{placeholder}' placeholders in input prompt than actual multimodal "
                              "data items.", "messages")
        missing.extend([placeholder] * counts[placeholder])
    return "\n".join([*missing, text] if text else missing)


def _content(raw: Any, fmt: ContentFormat, placeholders: Mapping[str, str]) -> str | list[dict[str, str]]:
    if raw is None:
        parts: list[Any] = []
    elif isinstance(raw, str):
        parts = [raw]
    elif isinstance(raw, list):
        parts = raw
    else:
        raise RenderError("Message content must be a string, a list of parts, or null.", "messages")
    items: list[dict[str, str]] = []
    found: list[str] = []
    for part in parts:
        modality = _media_modality(part, placeholders)
        if modality is None:
            text = _part_text(part)
            if text is not None:
                items.append({"type": "text", "text": text})
        elif part.get(part["type"]) is not None or part.get("uuid") is not None:  # vLLM skips empty parts
            items.append({"type": modality})
            found.append(placeholders[modality])
    if fmt == "openai":
        return items
    text = "\n".join(item["text"] for item in items if item["type"] == "text")
    return _with_placeholders(found, text) if found else text


def _decoded_tool_calls(tool_calls: Any) -> list[Any]:
    """Tool-call arguments arrive as JSON strings; templates expect dicts (vLLM's _postprocess_messages)."""
    if not isinstance(tool_calls, list):
        raise RenderError("tool_calls must be a list.", "messages")
    calls = copy.deepcopy(tool_calls)
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RenderError("Each tool call needs a function object.", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
    return calls


def _conversation_message(message: Any, fmt: ContentFormat, placeholders: Mapping[str, str]) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RenderError("Each message must be an object.", "messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise RenderError("Each message needs a string 'role'.", "messages")
    content = _content(message.get("content"), fmt, placeholders)
    out: dict[str, Any] = {"role": role, "content": content}
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            decoded = _decoded_tool_calls(tool_calls)
            if decoded:
                out["tool_calls"] = decoded
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list):
            out["content"] = "\n".join(part["text"] for part in content if part["type"] == "text")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def conversation(messages: Any, fmt: ContentFormat, placeholders: Mapping[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """The list of conversation messages vLLM passes to ``apply_chat_template``; never mutates input.
    ``placeholders`` (modality -> placeholder text) are the media the model takes; other media parts are
    refused, as by a text-only model."""
    if not isinstance(messages, list):
        raise RenderError("'messages' must be a list.", "messages")
    return [_conversation_message(message, fmt, placeholders or {}) for message in messages]
