"""Convert a llama-architecture GGUF file into an HF-format model directory.

Owns ``import_gguf``: read the file with the ``gguf`` package, dequantize every tensor to float32
with ``gguf.quants.dequantize`` (the same routine HF transformers uses, so the weights equal HF's
own GGUF loading bit for bit), undo llama.cpp's rotary row permutation of the Q and K projections,
and write ``model.safetensors``, ``config.json``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json``. It never loads the model and never touches an existing directory.

Invariant: a directory at ``out_dir`` is either absent or complete. Everything is written into a
temporary sibling first and renamed into place at the end, with the marker file
``IMPORT_MARKER_NAME`` written last inside it.
"""

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm  # no types-tqdm in the dev extras yet

from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config, read_gguf_vocab

SUPPORTED_ARCHITECTURE = "llama"
IMPORT_MARKER_NAME = "kunlun_gguf_import.json"
IMPORT_FORMAT_VERSION = 1  # bump when the output changes, so caches of older imports are redone
_T = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset(
    {_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1}
    | {_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True, slots=True)
class LlamaHparams:
    """The model shape a llama GGUF declares under ``llama.*``."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # linear rope scaling; None when the file has none


def open_gguf(path: Path) -> GGUFReader:
    """A reader over ``path``. Raises ModelLoadError if it is missing or not a readable GGUF."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist or is not a file")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({error})") from error


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value of the file, decoded (strings as ``str``, arrays as lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except (ValueError, UnicodeDecodeError, IndexError) as error:
        raise ModelLoadError(f"GGUF metadata cannot be decoded ({error})") from error


def _shortest_float32(value: float) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def read_hparams(metadata: dict[str, Any]) -> LlamaHparams:
    """The llama hyper-parameters. Raises ModelLoadError for another architecture or missing keys."""
    architecture = metadata.get("general.architecture")
    if architecture != SUPPORTED_ARCHITECTURE:
        raise ModelLoadError(
            f"GGUF architecture {architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURE!r}"
        )

    def need(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise ModelLoadError(f"GGUF lacks the required key llama.{key}")
        return metadata[f"llama.{key}"]

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = metadata.get("llama.attention.key_length", hidden // heads)
    for key in ("rope.dimension_count", "attention.value_length"):
        if metadata.get(f"llama.{key}", head_dim) != head_dim:
            raise ModelLoadError(f"GGUF llama.{key} differs from the head size {head_dim}; not supported")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported; supported: 'none', 'linear'")
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    return LlamaHparams(
        num_layers=need("block_count"),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_heads=heads,
        num_kv_heads=metadata.get("llama.attention.head_count_kv", heads),
        head_dim=head_dim,
        vocab_size=metadata.get("llama.vocab_size", len(tokens)),
        max_position_embeddings=need("context_length"),
        rms_norm_eps=_shortest_float32(need("attention.layer_norm_rms_epsilon")),
        rope_theta=_shortest_float32(metadata.get("llama.rope.freq_base", 10000.0)),
        rope_scaling_factor=float(need("rope.scaling.factor")) if scaling == "linear" else None,
    )


def build_config(hparams: LlamaHparams, metadata: dict[str, Any], *, tied: bool) -> dict[str, Any]:
    """``config.json`` for ``LlamaForCausalLM``, readable by old (rope_theta) and new (rope_parameters)
    transformers alike."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": hparams.rope_theta}
    rope_scaling = None
    if hparams.rope_scaling_factor is not None:
        rope_scaling = {"rope_type": "linear", "factor": hparams.rope_scaling_factor}
        rope_parameters.update(rope_scaling)
    token_ids = {
        f"{name}_token_id": metadata.get(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hparams.hidden_size,
        "intermediate_size": hparams.intermediate_size,
        "num_hidden_layers": hparams.num_layers,
        "num_attention_heads": hparams.num_heads,
        "num_key_value_heads": hparams.num_kv_heads,
        "head_dim": hparams.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hparams.max_position_embeddings,
        "rms_norm_eps": hparams.rms_norm_eps,
        "rope_theta": hparams.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": hparams.vocab_size,
        **token_ids,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary permutation of Q/K rows (``num_heads``: KV heads for K).

    llama.cpp stores each head's rows as interleaved (even, odd) rotary pairs; HF keeps the first
    half of the head's rows, then the second half.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(name: str, num_layers: int) -> str:
    """The HF parameter name of a GGUF tensor. Raises ModelLoadError for tensors we cannot place."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES and int(match.group(1)) < num_layers:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    if name == "rope_freqs.weight":
        raise ModelLoadError("GGUF tensor rope_freqs.weight (Llama 3.1 rope scaling) is not supported yet")
    raise ModelLoadError(f"GGUF tensor {name!r} has no place in a LlamaForCausalLM model")


def _expected_shape(hf_name: str, hp: LlamaHparams) -> tuple[int, ...]:
    q_rows, kv_rows = hp.num_heads * hp.head_dim, hp.num_kv_heads * hp.head_dim
    for suffix, shape in (
        ("embed_tokens.weight", (hp.vocab_size, hp.hidden_size)),
        ("lm_head.weight", (hp.vocab_size, hp.hidden_size)),
        ("q_proj.weight", (q_rows, hp.hidden_size)),
        ("k_proj.weight", (kv_rows, hp.hidden_size)),
        ("v_proj.weight", (kv_rows, hp.hidden_size)),
        ("o_proj.weight", (hp.hidden_size, q_rows)),
        ("gate_proj.weight", (hp.intermediate_size, hp.hidden_size)),
        ("up_proj.weight", (hp.intermediate_size, hp.hidden_size)),
        ("down_proj.weight", (hp.hidden_size, hp.intermediate_size)),
    ):
        if hf_name.endswith(suffix):
            return shape
    return (hp.hidden_size,)  # the RMSNorm weights


def _required_names(hp: LlamaHparams) -> set[str]:
    parts = _LAYER_NAMES.values()
    names = {f"model.layers.{i}.{part}.weight" for i in range(hp.num_layers) for part in parts}
    return names | {"model.embed_tokens.weight", "model.norm.weight"}


def plan_tensors(reader: GGUFReader, hp: LlamaHparams) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every output tensor, checked before any work is done.

    Raises:
        ModelLoadError: an unsupported tensor type (naming tensor and type), an unknown or missing
            tensor, or a shape that contradicts the hyper-parameters.
    """
    plan: dict[str, tuple[int, ...]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported; "
                f"supported: {supported}"
            )
        hf_name = hf_tensor_name(tensor.name, hp.num_layers)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if shape != _expected_shape(hf_name, hp):
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has shape {shape}, expected {_expected_shape(hf_name, hp)}"
            )
        plan[hf_name] = shape
    missing = sorted(_required_names(hp) - plan.keys())
    if missing:
        raise ModelLoadError(f"GGUF lacks {len(missing)} required tensor(s), e.g. {missing[0]}")
    return plan


def iter_hf_tensors(reader: GGUFReader, hp: LlamaHparams, *, progress: bool) -> Iterator[np.ndarray]:
    """Each tensor of the file, in file order, dequantized to float32 and in HF layout."""
    for tensor in tqdm(reader.tensors, desc="Importing GGUF tensors", unit="tensor", disable=not progress):
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if tensor.name.endswith(".attn_q.weight"):
            weight = unpermute_rows(weight, hp.num_heads)
        elif tensor.name.endswith(".attn_k.weight"):
            weight = unpermute_rows(weight, hp.num_kv_heads)
        yield weight


def write_safetensors_streaming(
    path: Path, shapes: dict[str, tuple[int, ...]], tensors: Iterator[np.ndarray]
) -> None:
    """Write float32 ``tensors`` (in the order of ``shapes``) as one safetensors file, one at a time.

    The header is computed from the shapes alone, so at most one dequantized tensor is ever held in
    memory; a 7B model imports in a few GiB of RAM instead of 28.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, shape), tensor in zip(shapes.items(), tensors, strict=True):
            assert tensor.shape == shape and tensor.dtype == np.float32, name
            file.write(np.ascontiguousarray(tensor).tobytes())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_model(gguf_path: Path, tmp: Path, *, progress: bool) -> None:
    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    hparams = read_hparams(metadata)
    plan = plan_tensors(reader, hparams)
    vocab = read_gguf_vocab(metadata)
    if len(vocab.tokens) != hparams.vocab_size:
        raise ModelLoadError(f"GGUF has {len(vocab.tokens)} tokens but vocabulary size {hparams.vocab_size}")
    tokenizer = build_tokenizer(vocab)
    config = build_config(hparams, metadata, tied="lm_head.weight" not in plan)
    tokenizer.save(str(tmp / "tokenizer.json"))
    tokenizer_config = build_tokenizer_config(vocab, model_max_length=hparams.max_position_embeddings)
    _write_json(tmp / "tokenizer_config.json", tokenizer_config)
    _write_json(tmp / "config.json", config)
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {key: config[key] for key in ids if config[key] is not None}
    _write_json(tmp / "generation_config.json", generation)
    tensors = iter_hf_tensors(reader, hparams, progress=progress)
    write_safetensors_streaming(tmp / "model.safetensors", plan, tensors)
    size = gguf_path.stat().st_size
    marker = {"format_version": IMPORT_FORMAT_VERSION, "source": str(gguf_path), "source_size_bytes": size}
    _write_json(tmp / IMPORT_MARKER_NAME, marker)


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into the HF-format directory ``out_dir`` and return ``out_dir``.

    Args:
        gguf_path: a llama-architecture GGUF file.
        out_dir: where the model directory goes; it must not exist (or be an empty directory).
        progress: show a progress bar over the tensors on stderr.

    Raises:
        ModelLoadError: the file is missing, not a GGUF, of another architecture, holds an
            unsupported tensor type or tokenizer, or ``out_dir`` already holds something.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        raise ModelLoadError(f"output directory {out_dir} already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        _write_model(gguf_path, tmp, progress=progress)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model directory is an ordinary one
        if out_dir.is_dir():
            out_dir.rmdir()  # empty, checked above; a concurrent writer makes rename fail below
        os.rename(tmp, out_dir)
    except OSError as error:
        raise ModelLoadError(f"cannot write the imported model to {out_dir} ({error})") from error
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
