"""KV cache: block layout, block pool with prefix reuse, per-request block tables, cache tensors."""
