"""Sans-IO parsing of an OpenAI server-sent-event stream into content deltas and usage."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


class SseSplitter:
    """Turns arbitrary byte chunks into the ``data`` payloads of complete events."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        payloads = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                payloads.append(b"\n".join(data).decode("utf-8", errors="replace"))
        return payloads


@dataclass
class StreamedAnswer:
    """What the events of one streamed completion said, with the count of events that made no sense."""

    content: list[str] = field(default_factory=list)
    content_chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache (``usage.prompt_tokens_details``)."""
    done: bool = False
    malformed: int = 0
    error: str = ""

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    def apply(self, payload: str) -> bool:
        """Record one event's payload; True when it carried the first piece of generated text."""
        if payload.strip() == "[DONE]":
            self.done = True
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            self.malformed += 1
            return False
        if not isinstance(event, dict):
            self.malformed += 1
            return False
        if isinstance(event.get("error"), dict | str):
            self.error = str(event["error"])[:200]
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage_tokens, self.prompt_tokens, self.cached_tokens = usage_counts(usage)
        piece = _content_of(event)
        if not piece:
            return False
        first = self.content_chunks == 0
        self.content.append(piece)
        self.content_chunks += 1
        return first


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_counts(usage: dict) -> tuple[int | None, int | None, int | None]:
    """(completion, prompt, cached prompt) tokens of an OpenAI ``usage`` object; None where absent.

    vLLM reports ``prompt_tokens_details.cached_tokens`` per request (with
    ``--enable-prompt-tokens-details``; the simulated engine always does).
    """
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return _count(usage.get("completion_tokens")), _count(usage.get("prompt_tokens")), cached


def _content_of(event: dict) -> str:
    """The generated text of a chat (``delta.content``) or completions (``text``) chunk."""
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return piece if isinstance(piece, str) else ""
