"""PEFT LoRA adapters for tests: made by ``peft`` itself on a (tiny or real) base model, with
random non-zero A and B so that every targeted projection really changes the output."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: Path,
    directory: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_PROJECTIONS,
    use_rslora: bool = False,
    seed: int = 1,
    scale: float = 0.2,
    **config: object,
) -> Path:
    """Save a random LoRA adapter of ``base_dir`` into ``directory``; returns the directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, **config
    )
    model = get_peft_model(base, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(directory)
    return directory
