"""The simulated vLLM engine: paged KV cache with vLLM's hashing, continuous batching, timing profiles, faults."""
