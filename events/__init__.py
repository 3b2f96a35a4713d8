"""vLLM's KV events: the ZMQ subscriber and replay client, decoding both encodings, sequence gaps, /metrics."""
