"""How much of each request the engine could have served from its cache: its shared prefix in blocks.

Definition, on which the request-level hit rate rests: a request's shared prefix is its chat up to,
not including, its final user message (the system prompt, then earlier turns with their answers),
rendered with the chat template and tokenized as vLLM tokenizes chat prompts. An engine serves only
whole blocks from its cache, so the judged length is that token count rounded down to the block size.
A request hits when the engine's ``usage.prompt_tokens_details.cached_tokens`` is at least that long:
the engine found every full block of what the request shares with earlier ones. Its own question and
the last partial block are never cached, which is why the token-level rate cannot reach 100%.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from bench.stats import RequestResult
from bench.workloads import Conversation, Message
from tokenization.render import render_chat


class PrefixMeter:
    """Counts shared-prefix tokens with the engines' tokenizer; each distinct prefix is counted once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._counts: dict[str, int] = {}

    def reusable_tokens(self, prefix: list[Message]) -> int:
        """Tokens of ``prefix`` in whole blocks; 0 for an empty prefix."""
        if not prefix:
            return 0
        text = render_chat(self.tokenizer, {"messages": prefix, "add_generation_prompt": False})
        if text not in self._counts:
            self._counts[text] = len(self.tokenizer.encode(text, add_special_tokens=False))
        return self._counts[text] // self.block_size * self.block_size

    def assign(self, results: list[RequestResult], conversations: list[Conversation]) -> None:
        """Fill ``reusable_tokens`` of each result from the conversation turn it sent.

        Called after the run, so counting costs the load generator no CPU while it measures.
        """
        by_key = {c.key: c for c in conversations}
        for result in results:
            conv = by_key.get(result.key)
            if conv is not None:
                result.reusable_tokens = self.reusable_tokens(conv.prefix_messages(result.turn))
