"""The ``[multimodal."<model>"]`` tables: what each image or audio item of a model's chats becomes in its prompt.

The router cannot run a model's multimodal processor, so an operator states, per model and modality, the
placeholder token the processor expands and the tokens it expands one item to (``tokenization.media``):
LLaVA-1.5 is ``image = { token_id = 32000, tokens = 576 }``. A model without a table is routed on text as
before, its image and audio chats without cache knowledge and forwarded unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config_errors import ConfigError
from tokenization.media import Placeholder

MAX_ITEM_TOKENS = 1 << 20


@dataclass
class MediaPlaceholderConfig:
    token_id: int
    tokens: int
    text: str | None = None
    """The placeholder text vLLM writes for an item in a string chat template (its model's
    ``get_placeholder_str``); the token's own text when unset."""

    def validate(self, where: str) -> None:
        if self.token_id < 0:
            raise ConfigError(f"{where}.token_id: must be a token id (>= 0)")
        if not 1 <= self.tokens <= MAX_ITEM_TOKENS:
            raise ConfigError(f"{where}.tokens: must be between 1 and {MAX_ITEM_TOKENS}")
        if self.text is not None and not self.text:
            raise ConfigError(f"{where}.text: must not be empty")


@dataclass
class MultimodalModelConfig:
    image: MediaPlaceholderConfig | None = None
    audio: MediaPlaceholderConfig | None = None

    def validate(self, where: str) -> None:
        for modality, setting in self.modalities().items():
            setting.validate(f"{where}.{modality}")

    def modalities(self) -> dict[str, MediaPlaceholderConfig]:
        return {m: s for m, s in (("image", self.image), ("audio", self.audio)) if s is not None}

    def placeholders(self, token_text: Callable[[int], str]) -> dict[str, Placeholder]:
        """Each modality's placeholder, its text from the tokenizer when the table names none."""
        return {m: Placeholder(s.token_id, s.tokens, s.text if s.text is not None else token_text(s.token_id))
                for m, s in self.modalities().items()}
