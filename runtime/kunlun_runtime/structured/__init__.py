"""Structured outputs: constraints on what a request may generate (JSON Schema, JSON object,
regex, choice, Lark grammar), compiled once per constraint and applied as a token mask before
sampling. ``params`` says what a request asks for; ``grammar`` compiles it and tracks each
request's state; ``bitmask`` applies the allowed-token masks to the logits."""
