"""``LoRARequest``: an adapter as a request names it, with vLLM's fields and positional order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: its served name, a positive integer id unique among the loaded adapters (the id
    KV cache events carry), the directory of its PEFT checkpoint, and optionally the base model it
    was trained on (checked against the served model's name where given)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
