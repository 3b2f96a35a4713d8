"""Image and audio parts on the simulated engine, as vLLM's chat server and processor treat them.

Each item becomes its placeholder token, expanded to the configured run (``--mm-placeholder``, what a real
model's processor fixes); its identifier is the part's ``uuid`` when the request sent one (vLLM's
``multi_modal_uuids``), else the engine's own hash of the item and the model, which a router cannot
reproduce (vLLM hashes the decoded media). The runs and identifiers key the blocks (``index.media_keys``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from index.media_keys import MediaSpan
from tokenization.media import MediaItem, Placeholder, expand, media_parts, part_content
from tokenization.messages import MEDIA_MODALITIES, RenderError

MediaSetting = tuple[tuple[str, int, int], ...]
"""(modality, placeholder token id, tokens per item) per modality the simulated model takes."""


def parse_placeholder(value: str) -> tuple[str, int, int]:
    """``image=ID:TOKENS`` -> (modality, id, tokens); ValueError says what is wrong."""
    modality, _, rest = value.partition("=")
    token, _, count = rest.partition(":")
    if modality not in ("image", "audio") or not token.isdigit() or not count.isdigit() or int(count) < 1:
        raise ValueError(f"mm-placeholder takes image=ID:TOKENS or audio=ID:TOKENS, got {value!r}")
    return modality, int(token), int(count)


def engine_items(body: dict[str, Any], model: str) -> list[MediaItem]:
    """The request's items with the identifiers the engine keys them by."""
    items = []
    for part in media_parts(body.get("messages")):
        modality, content = MEDIA_MODALITIES[part["type"]], part_content(part)
        uuid = part.get("uuid")
        if uuid is not None:
            items.append(MediaItem(modality, str(uuid)))
        elif content is not None:
            digest = hashlib.sha256(repr((model, modality, content)).encode("utf-8", "surrogatepass"))
            items.append(MediaItem(modality, digest.hexdigest()))
    return items


def placeholders(setting: MediaSetting, token_text: Any) -> dict[str, Placeholder]:
    return {modality: Placeholder(token, count, token_text(token)) for modality, token, count in setting}


def expanded(ids: list[int], body: dict[str, Any], model: str, found: dict[str, Placeholder]
             ) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """The prompt after expansion and its items' runs; a RenderError when placeholders and items disagree."""
    items = engine_items(body, model)
    if not items:
        return ids, ()
    result = expand(ids, items, found)
    if result is None:
        raise RenderError("The number of multimodal placeholders does not match the number of items.",
                          "messages")
    return result
