"""Image and audio parts of a chat: their identifiers and the placeholder tokens vLLM expands them to.

vLLM's chat server writes one placeholder per item into the prompt (a string template gets the model's
placeholder text in front of the message's text; a template that loops over parts gets ``{"type":
"image"}``), tokenizes, and its multimodal processor then replaces each placeholder token with the run of
tokens the item's embeddings fill. The router cannot run that processor (it would need the model's image
and audio code and the media themselves), so a model's placeholder token and the tokens per item are a
setting (``Placeholder``): right for models whose processor replaces one placeholder token with a fixed
number of copies of it (LLaVA-1.5: ``<image>`` x 576), wrong for models whose count depends on the image's
size or that insert other tokens into the run; there the blocks from the first item on do not match, and
only the prompt before it is found cached.

Each item's identifier is a content hash the router sends as the part's ``uuid``, vLLM 0.32's chat form of
``multi_modal_uuids``: the engine then keys the item's blocks with it instead of its own hash of the decoded
media, which the router cannot compute. The hash is of what the request carries (the URL string, a data
URL's text, an audio part's data and format): nothing is fetched or decoded. A client's own ``uuid`` is
replaced when the part carries content, because vLLM trusts it: a tenant naming another tenant's image with
its own picture would otherwise poison the engine's caches for that image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from index.media_keys import MediaSpan
from tokenization.messages import MEDIA_MODALITIES

ID_PREFIX = "kvmesh-"


@dataclass(frozen=True, slots=True)
class Placeholder:
    """What one item of a modality becomes in the prompt: the placeholder text written for it (its token's
    text unless the model's differs), the token the engine expands, and how many tokens it expands to."""

    token_id: int
    tokens: int
    text: str


@dataclass(frozen=True, slots=True)
class MediaItem:
    modality: str
    identifier: str


def part_content(part: Mapping[str, Any]) -> Any:
    """The item a media part carries (a URL string or an audio object), None when it carries none."""
    content = part.get(part["type"])
    return content.get("url") if part["type"] != "input_audio" and isinstance(content, dict) else content


def content_hash(modality: str, content: Any) -> str:
    """The identifier of an item's content: a hash of the request's own text of it, stable across routers."""
    text = f"{content.get('format')}\x00{content.get('data')}" if isinstance(content, dict) else str(content)
    digest = hashlib.blake2b(f"{modality}\x00{text}".encode("utf-8", "surrogatepass"), digest_size=32)
    return ID_PREFIX + digest.hexdigest()


def media_parts(messages: Any) -> list[dict[str, Any]]:
    """Every media part of a chat's messages, in order (non-dicts and text are skipped)."""
    found = []
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_MODALITIES:
                found.append(part)
    return found


def with_uuids(body: dict[str, Any]) -> tuple[dict[str, Any], tuple[MediaItem, ...]]:
    """The body to forward, each media part carrying its item's identifier as ``uuid``, and the items in
    order. A body without media parts is returned as is (the caller forwards its original bytes); a part
    without content keeps the client's ``uuid`` (vLLM then reuses what it cached under it); a part with
    neither is skipped, as vLLM skips it."""
    if not media_parts(body.get("messages")):
        return body, ()
    items: list[MediaItem] = []
    messages = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in MEDIA_MODALITIES:
                modality, found = MEDIA_MODALITIES[part["type"]], part_content(part)
                uuid = content_hash(modality, found) if found is not None else part.get("uuid")
                if uuid is not None:
                    part = {**part, "uuid": str(uuid)}
                    items.append(MediaItem(modality, str(uuid)))
            parts.append(part)
        messages.append({**message, "content": parts})
    return {**body, "messages": messages}, tuple(items)


def expand(token_ids: Sequence[int], items: Sequence[MediaItem], placeholders: Mapping[str, Placeholder]
           ) -> tuple[list[int], tuple[MediaSpan, ...]] | None:
    """The ids after the engine's processor expands each item's placeholder token, and each item's run.
    The k-th placeholder token of a modality is the k-th item of it, as vLLM matches them. None when the
    placeholders and the items disagree (the engine refuses such a request)."""
    by_token = {p.token_id: (modality, p.tokens) for modality, p in placeholders.items()}
    queues = {modality: [i for i in items if i.modality == modality] for modality in placeholders}
    if any(item.modality not in queues for item in items):
        return None
    out: list[int] = []
    spans: list[MediaSpan] = []
    for token in token_ids:
        found = by_token.get(token)
        if found is None:
            out.append(token)
            continue
        modality, count = found
        if not queues[modality]:
            return None
        spans.append(MediaSpan(queues[modality].pop(0).identifier, len(out), count))
        out.extend([token] * count)
    if any(queues.values()):
        return None
    return out, tuple(spans)
