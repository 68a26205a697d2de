"""A tiny Llama checkpoint whose greedy answer to any chat prompt is a script the test chose.

For tests that need a model to say something exact (a tool call in a parser's format) through
the real engine and server, where a random model says noise. The weights make the next token a
function of the current token only: attention and MLP write nothing (``o_proj`` and
``down_proj`` are zero), so the last hidden state is the current token's embedding; each token
of the script has its own embedding axis, and ``lm_head`` maps that axis to the next token. The
script's pieces are added to the tokenizer as tokens of their own, so that each appears once in
the chain: the generation prompt's last token (the ``"\\n"`` after ``<|im_start|>assistant``) →
piece 1 → … → piece n → ``<|im_end|>`` (end of sequence). Every other token has a zero
embedding, hence all-zero logits: what follows it is not part of the contract.

Nothing here changes the product; the engine runs this checkpoint as it runs any Llama.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from tests.support.tiny_models import CHATML, build_tokenizer

HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
INTERMEDIATE = 32
VOCAB_SIZE = 320  # room for the byte-level base, the specials and the script's pieces
AFTER = "\n"  # the chat template's generation prompt ends with it: the script starts after it


def scripted_tokenizer(script: Sequence[str]) -> tuple[Tokenizer, list[int]]:
    """The tiny byte-level tokenizer with each piece of ``script`` added as one token; returns it
    and the chain of token ids (``AFTER``, the pieces, then the end of sequence)."""
    if len(set(script)) != len(script) or not script:
        raise ValueError(f"a script is a non-empty list of distinct pieces, got {script!r}")
    tokenizer = build_tokenizer()
    start = tokenizer.encode(AFTER).ids
    assert len(start) == 1, start  # one byte, one token
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in script])
    pieces = [tokenizer.token_to_id(piece) for piece in script]
    end = tokenizer.token_to_id("<|im_end|>")
    chain = [start[0], *pieces, end]
    if len(set(chain)) != len(chain) or tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise ValueError(f"the script's pieces must be new tokens within {VOCAB_SIZE}: {script!r}")
    return tokenizer, chain


def scripted_weights(chain: Sequence[int], num_layers: int = 1) -> dict[str, torch.Tensor]:
    """Llama weights (HF names) under which token ``chain[i]`` is followed by ``chain[i + 1]``."""
    if len(chain) - 1 > HIDDEN:
        raise ValueError(f"a script of at most {HIDDEN - 1} pieces, got {len(chain) - 2}")
    embed = torch.zeros(VOCAB_SIZE, HIDDEN)
    head = torch.zeros(VOCAB_SIZE, HIDDEN)
    for axis, (token, following) in enumerate(itertools.pairwise(chain)):
        embed[token, axis] = 1.0  # after RMSNorm: sqrt(HIDDEN) on this axis alone
        head[following, axis] = 1.0  # so that token's logit is 8, every other 0
    weights = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": head,
    }
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "self_attn.q_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": torch.zeros(HIDDEN, HEADS * HEAD_DIM),
            prefix + "mlp.gate_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
            prefix + "input_layernorm.weight": torch.ones(HIDDEN),
            prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    return weights


def make_scripted_model(directory: Path, script: Sequence[str]) -> Path:
    """Save the checkpoint whose greedy answer to any ChatML prompt is ``"".join(script)`` then
    the end of sequence; returns ``directory``."""
    tokenizer, chain = scripted_tokenizer(script)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": chain[-1],
        "torch_dtype": "float32",
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(scripted_weights(chain), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"})
    )
    return directory
