"""Render and tokenize prompts exactly as vLLM does; the embedded default tokenizer."""
