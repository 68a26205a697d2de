"""The decoder-only transformer of the Llama family (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM).

Module names mirror the HF reference (``embed_tokens``, ``layers.N.self_attn``, ``norm``,
``lm_head``) so that golden runs can compare layer by layer. Inputs are flat: all tokens of a
batch in one [T] tensor with their positions, attention over the paged KV cache. Projections are
fused at load time (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``).

Under pipeline parallelism a model is one stage: a contiguous range of the layers, the embedding
only on the first stage and the final norm and ``lm_head`` only on the last. A stage's layers
index its own KV cache from 0 (it holds the KV of its layers only); ``first_layer`` maps them
back to the checkpoint's numbering.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from kunlun_runtime.kv.cache import KVCache
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import AttentionMetadata
from kunlun_runtime.layers.attention_backend import AttentionShape, PagedAttention, kernels_read_cache
from kunlun_runtime.layers.linear import Int8Linear, NativeLinear, first_matrix
from kunlun_runtime.layers.lora import LoRABatch, LoRAProjection
from kunlun_runtime.layers.norm import RMSNorm
from kunlun_runtime.layers.rotary import RotaryEmbedding
from kunlun_runtime.models.model_config import ModelConfig


def _weight(rows: int, cols: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, cols), requires_grad=False)


class Attention(nn.Module):
    """Q/K/V projection, optional Q/K norms, paged attention (its kernel chosen in ``layers``), and
    the output projection (all-reduced across tensor-parallel ranks)."""

    def __init__(self, config: ModelConfig, layer_index: int, tp_world: int = 1) -> None:
        super().__init__()
        self.tp_world = tp_world
        self.tp_group: ProcessGroup | None = None  # None: the default group (tensor parallelism alone)
        self.layer_index = layer_index  # in this stage's KV cache
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.attn = PagedAttention(AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim))
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.lora: dict[str, LoRAProjection] = {}  # "qkv_proj", "o_proj" where LoRA is enabled

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = self.lora["qkv_proj"].add_update(x, qkv, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None  # set together in __init__
            q, k = self.q_norm(q), self.k_norm(k)
        k_blocks, v_blocks = kv_cache.k_blocks[self.layer_index], kv_cache.v_blocks[self.layer_index]
        attended = self.attn.forward(q, k, v, cos_sin, k_blocks, v_blocks, meta)
        out = self.o_proj(attended)
        if lora is not None:  # before the all-reduce: the partial updates sum like the outputs
            out = self.lora["o_proj"].add_update(attended, out, lora)
        if self.tp_world > 1:  # row-parallel: sum the ranks' partial outputs
            dist.all_reduce(out, group=self.tp_group)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_world: int = 1) -> None:
        super().__init__()
        self.tp_world = tp_world
        self.tp_group: ProcessGroup | None = None
        self.intermediate_size = config.intermediate_size
        self.native = False  # SiLU(gate) * up through our CPU kernel
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.lora: dict[str, LoRAProjection] = {}  # "gate_up_proj", "down_proj" where LoRA is enabled

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = self.lora["gate_up_proj"].add_update(x, gate_up, lora)
        if self.native and gate_up.dim() == 2:
            hidden = cpu_kernels.silu_mul(gate_up.contiguous())
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate) * up
        out = self.down_proj(hidden)
        if lora is not None:
            out = self.lora["down_proj"].add_update(hidden, out, lora)
        if self.tp_world > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp_world: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp_world)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp_world)

    def forward(self, x, cos_sin, kv_cache, meta, lora: LoRABatch | None = None) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, lora)
        norm = self.post_attention_layernorm
        if norm.uses_native(x):  # the residual add and the norm in one pass, same roundings
            x, h = cpu_kernels.add_rms_norm(x, attn_out.contiguous(), norm.weight, norm.eps)
            return x + self.mlp(h, lora)
        x = x + attn_out
        return x + self.mlp(norm(x), lora)


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, tp_world: int = 1, layers: range | None = None
    ) -> None:
        """``layers``: the stage's range of the model's layers (default: all of them)."""
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        self.is_first_stage = layers.start == 0
        self.is_last_stage = layers.stop == config.num_layers
        self.first_layer = layers.start
        # Per-rank shapes under tensor parallelism, and the stage's layer count under pipeline
        # parallelism (what its KV cache is sized for).
        self.config = replace(config, num_layers=len(layers))
        self.tp_world = tp_world
        self.embed_tokens: nn.Embedding | None = None
        if self.is_first_stage:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp_world) for i in range(len(layers)))
        self.norm: RMSNorm | None = None
        self.lm_head: nn.Linear | None = None
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
        # Set by enable_native_kernels where one C++ call can run every layer of a decode step of
        # up to decode_max_rows sequences; decode_lora by lora.slots where LoRA is enabled.
        self.decode_weights: list[torch.Tensor] | None = None
        self.decode_lora: list[torch.Tensor] | None = None
        self.decode_max_rows = cpu_kernels.MAX_ROWS
        # The decode rows our linears serve per read of the weights (None: no native kernels).
        self.decode_pass_rows: int | None = None
        self.native_kernels = False  # set by enable_native_kernels
        # The activations' dtype where it differs from the weights' (FP32 over BF16 weights on CPUs
        # without native BF16); None: the embedding's dtype. Set by the loader.
        self.compute_dtype: torch.dtype | None = None
        # The dtype the loader cast the matrices to (a later stage of an INT8 model has none left
        # to look at); None: the weight matrices' own.
        self.weight_dtype: torch.dtype | None = None

    @property
    def weight_matrix(self) -> torch.Tensor:
        """A matrix in the model's weight dtype, on its device: the embedding, or on a later
        pipeline stage its first linear's weight."""
        return self.embed_tokens.weight if self.embed_tokens is not None else first_matrix(self)

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.weight_matrix.dtype

    def set_tensor_parallel_group(self, group: ProcessGroup | None) -> None:
        """The group the layers all-reduce over (a stage's ranks under pipeline parallelism)."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.tp_group = group

    def enable_native_kernels(self) -> bool:
        """Routes RMSNorm, SiLU·up and decode attention through our CPU kernels of the tier that
        computes in the model's activation dtype (``cpu_kernels``); returns False, changing
        nothing, where they are unavailable or the weights are not BF16."""
        weight = self.weight_matrix
        if (self.weight_dtype or weight.dtype) != torch.bfloat16 or weight.device.type != "cpu":
            return False
        if not cpu_kernels.load(self.activation_dtype):
            return False
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.native = True
            elif isinstance(module, Attention):
                module.attn.native = True
        self.decode_weights = self._collect_decode_weights()
        quantized = any(isinstance(module, Int8Linear) for module in self.layers.modules())
        self.decode_pass_rows = cpu_kernels.weight_pass_rows(quantized)
        self.native_kernels = True
        return True

    def _collect_decode_weights(self) -> list[torch.Tensor] | None:
        """The per-layer tensors of ``cpu_kernels.decode_layers``, or None where the layer stack
        needs Python between operators (tensor-parallel all-reduces, Q/K norms, linears that are
        not ours, the unfused-attention ablation)."""
        if self.tp_world > 1 or self.config.qk_norm:
            return None
        none = torch.empty(0)

        def linear(module: nn.Module) -> list[torch.Tensor] | None:
            if isinstance(module, NativeLinear):
                bias = module.bias_fp32
                return [module.weight, none, none if bias is None else bias]
            if isinstance(module, Int8Linear) and module.native:
                return [module.weight_int8, module.scales_fp32, none if module.bias is None else module.bias]
            return None

        weights: list[torch.Tensor] = []
        quantized = any(isinstance(module, Int8Linear) for module in self.layers.modules())
        self.decode_max_rows = cpu_kernels.INT8_MAX_ROWS if quantized else cpu_kernels.MAX_ROWS
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)  # built so in __init__
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o_proj, gate_up, down = (
                linear(attn.qkv_proj),
                linear(attn.o_proj),
                linear(mlp.gate_up_proj),
                linear(mlp.down_proj),
            )
            if qkv is None or o_proj is None or gate_up is None or down is None or not attn.attn.fused:
                return None
            weights += [
                layer.input_layernorm.weight,
                *qkv,
                *o_proj[:2],
                layer.post_attention_layernorm.weight,
            ]
            weights += [*gate_up[:2], *down[:2]]
        return weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden]: after the final norm on the last stage, else the residual
        stream to hand to the next stage. Stages after the first take that stream as ``hidden``.
        ``lora``: the rows' adapters (None: every row on the base model)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids).to(self.activation_dtype)
        else:
            assert hidden is not None, "a later pipeline stage starts from the previous stage's output"
            x = hidden
        cos_sin = self.rotary.lookup(positions, x.dtype)
        if (lora is None or self.decode_lora is not None) and self._runs_fused_decode(meta, kv_cache):
            assert self.decode_weights is not None  # _runs_fused_decode checked it
            cos, sin = cos_sin
            x = cpu_kernels.decode_layers(
                x,
                cos.view(x.shape[0], -1),
                sin.view(x.shape[0], -1),
                self.decode_weights,
                kv_cache.k_blocks,
                kv_cache.v_blocks,
                meta.block_tables,
                meta.context_lens,
                (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim),
                self.config.rms_norm_eps,
                self.config.head_dim**-0.5,
                meta.sliding_window,
                None if lora is None else self.decode_lora,
                None if lora is None else lora.row_slots,
            )
            return x if self.norm is None else self.norm(x)
        for layer in self.layers:
            x = layer(x, cos_sin, kv_cache, meta, lora)
        return x if self.norm is None else self.norm(x)

    def _runs_fused_decode(self, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
        # Forward hooks on the layers (golden runs, calibration) need the per-layer path; so does a
        # cache the kernels do not read (its attention takes the torch path).
        return (
            self.decode_weights is not None
            and meta.max_query_len == 1
            and kernels_read_cache(self.activation_dtype, kv_cache.spec.dtype)
            and meta.block_tables.shape[0] <= self.decode_max_rows
            and not any(layer._forward_hooks for layer in self.layers)
        )

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits for the given rows of hidden states (the last stage only): in FP32, or with
        ``widen=False`` in the dtype ``lm_head`` computes them in (their precision either way;
        half the bytes to send where that is BF16)."""
        assert self.lm_head is not None, "only the last pipeline stage has lm_head"
        if hidden.shape[0] == 0:  # a step of prefill chunks that all stop short of their prompt's end
            dtype = torch.float32 if widen else self.activation_dtype
            return hidden.new_zeros((0, self.config.vocab_size), dtype=dtype)
        logits = self.lm_head(hidden)
        return logits.float() if widen else logits
