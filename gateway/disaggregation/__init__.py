"""Prefill/decode disaggregation: engine roles, the skip decider, vLLM's two P/D wire protocols and the flow
that drives a prefill leg and a decode leg for one request (see docs/disaggregation.md)."""
