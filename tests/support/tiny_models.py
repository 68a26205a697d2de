"""Factories for tiny random HF models of every supported architecture, saved as HF directories.

Each model is built with ``transformers`` itself (the FP32 reference), gets a byte-level BPE
``tokenizer.json`` with a ChatML template, and is saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 320


@dataclass(frozen=True)
class TinySpec:
    """One tiny architecture variant; ``extra`` goes into the HF config unchanged."""

    architecture: str = "LlamaForCausalLM"
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    hidden_size: int = 64
    num_layers: int = 2
    extra: dict[str, Any] = field(default_factory=dict)
    name: str = "llama-gqa"


TINY_SPECS = {
    spec.name: spec
    for spec in (
        TinySpec(name="llama-gqa"),
        TinySpec(name="llama-mha", num_kv_heads=4),
        TinySpec(name="llama-mqa", num_kv_heads=1, tie_word_embeddings=True),
        TinySpec(name="llama-head-dim", head_dim=32),
        TinySpec(
            name="llama3-rope",
            extra={
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        TinySpec(name="qwen2-bias", architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
        TinySpec(name="qwen3-qknorm", architecture="Qwen3ForCausalLM", head_dim=32),
        TinySpec(name="mistral", architecture="MistralForCausalLM", extra={"sliding_window": 4096}),
    )
}


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE over the 256 byte symbols plus a few merges and the ChatML specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def make_tiny_model(directory: Path, spec: TinySpec = TINY_SPECS["llama-gqa"], seed: int = 0) -> Path:
    """Save a random ``spec`` model with tokenizer into ``directory``; returns the directory."""
    import transformers

    tokenizer = build_tokenizer()
    eos_id = tokenizer.token_to_id("<|im_end|>")
    config_class = getattr(transformers, spec.architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2 + 32,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
        eos_token_id=eos_id,
        **spec.extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec.architecture)(config).to(torch.float32).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits are well separated
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "bias" in name:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    return directory


def make_tiny_llama_without_transformers(directory: Path, seed: int = 0) -> Path:
    """A random model of ``TINY_SPECS["llama-gqa"]``'s shape (HF config keys and weight names),
    written with ``safetensors`` alone: importing ``transformers`` costs many seconds, and a test
    that only needs some model to serve (not HF's numerics) does not need it."""
    from safetensors.torch import save_file

    spec = TINY_SPECS["llama-gqa"]
    tokenizer = build_tokenizer()
    hidden, head_dim = spec.hidden_size, spec.hidden_size // spec.num_heads
    intermediate = hidden * 2 + 32
    config = {
        "architectures": [spec.architecture],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "torch_dtype": "float32",
    }
    shapes = {"model.embed_tokens.weight": (VOCAB_SIZE, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (VOCAB_SIZE, hidden)
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (spec.num_heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (spec.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (spec.num_kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, spec.num_heads * head_dim),
            prefix + "mlp.gate_proj.weight": (intermediate, hidden),
            prefix + "mlp.up_proj.weight": (intermediate, hidden),
            prefix + "mlp.down_proj.weight": (hidden, intermediate),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    generator = torch.Generator().manual_seed(seed)
    tensors = {  # the same widened random init as make_tiny_model
        name: (1.0 + 0.1 * torch.randn(shape, generator=generator))
        if "norm" in name
        else 0.15 * torch.randn(shape, generator=generator)
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    return directory
