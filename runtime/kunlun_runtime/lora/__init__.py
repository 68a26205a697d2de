"""LoRA adapters on the base model: what a request names (``request``), reading a PEFT checkpoint
into fused low-rank weights (``checkpoint``), and which adapters are loaded and in which of the
model's slots (``registry``)."""
