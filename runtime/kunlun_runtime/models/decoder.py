"""The decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM).

Module names mirror the HF reference (``embed_tokens``, ``layers.N.self_attn``, ``norm``,
``lm_head``) so that golden runs can compare layer by layer. Inputs are flat: all tokens of a
batch in one [T] tensor with their positions, attention over the paged KV cache. Projections are
fused at load time (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kunlun_runtime.layers.attention import AttentionMetadata, paged_attention
from kunlun_runtime.layers.norm import RMSNorm
from kunlun_runtime.layers.rotary import RotaryEmbedding, apply_rotary
from kunlun_runtime.models.model_config import ModelConfig

if TYPE_CHECKING:  # the cache is handed in; models do not depend on kv
    from kunlun_runtime.kv.cache import KVCache


def _weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp_world: int = 1) -> None:
        super().__init__()
        self.tp_world = tp_world
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.fused_attention = True  # switched off only for the benchmark's ablation
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        out = paged_attention(
            q,
            k,
            v,
            kv_cache.k_blocks[self.layer_index],
            kv_cache.v_blocks[self.layer_index],
            meta,
            self.scale,
            fused=self.fused_attention,
        )
        out = self.o_proj(out)
        if self.tp_world > 1:  # row-parallel: sum the ranks' partial outputs
            dist.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_world: int = 1) -> None:
        super().__init__()
        self.tp_world = tp_world
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        if self.tp_world > 1:
            dist.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp_world: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp_world)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp_world)

    def forward(self, x, cos_sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp_world: int = 1) -> None:
        super().__init__()
        self.config = config  # per-rank shapes under tensor parallelism
        self.tp_world = tp_world
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp_world) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in FP32 for the given rows of hidden states."""
        return self.lm_head(hidden).float()
