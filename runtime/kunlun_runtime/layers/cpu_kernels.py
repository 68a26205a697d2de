"""Our own CPU kernels (``csrc/``: small-batch linears, RMSNorm, fused decode attention), built
once per machine with the local C++ compiler and cached.

``load()`` returns True when ``torch.ops.kunlun_cpu`` is usable: an x86 CPU with AVX-512 BF16 and
either a prebuilt library named by ``$KUNLUN_CPU_KERNELS_LIB`` (what the runtime image ships:
``python -m kunlun_runtime.layers.cpu_kernels --build-to FILE`` makes it, on any x86 machine with a
compiler) or a compiler for a build on first use (into ``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``; later processes load the cached library in milliseconds).
Otherwise ``unavailable_reason()`` says what is missing and callers keep the oneDNN path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = (
    Path(__file__).parent / "csrc" / "small_batch_linear.cpp",
    Path(__file__).parent / "csrc" / "amx_linear.cpp",
    Path(__file__).parent / "csrc" / "decode_ops.cpp",
    Path(__file__).parent / "csrc" / "decode_layers.cpp",
    Path(__file__).parent / "csrc" / "argmax.cpp",
)
HEADERS = (Path(__file__).parent / "csrc" / "kernels.h", Path(__file__).parent / "csrc" / "bf16_vec.h")
# The largest batches our linears take instead of oneDNN: BF16 runs 3-16 rows in one AMX pass
# (measured faster than oneDNN up to 16 rows); the INT8 kernel is compute-bound above 8.
MAX_ROWS = 16
INT8_MAX_ROWS = 8
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
_COMPILE_FLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mamx-tile",
    "-mamx-bf16",
    "-fopenmp",
]


def _missing_cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(REQUIRED_CPU_FLAGS)
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]


def _compile() -> Path:
    """Compiles (or finds cached) and loads the library; returns its path."""
    from torch.utils import cpp_extension

    # The library's name carries a digest of the sources, so an edited kernel is rebuilt.
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))).hexdigest()[:10]
    name = f"kunlun_cpu_kernels_{digest}"
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=_COMPILE_FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"


@functools.cache
def _build() -> str | None:
    """Loads (building if needed) the library; returns None on success, else why it is unavailable."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU kernels need x86-64, this is {platform.machine()}"
    missing = _missing_cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    prebuilt = os.environ.get("KUNLUN_CPU_KERNELS_LIB")
    if prebuilt:
        try:
            torch.ops.load_library(prebuilt)
        except (OSError, RuntimeError) as exc:
            return f"loading KUNLUN_CPU_KERNELS_LIB={prebuilt} failed: {exc}"
    else:
        try:
            _compile()
        except Exception as exc:  # no compiler, no ninja, a compile error: all mean "not here"
            lines = str(exc).strip().splitlines() or [repr(exc)]
            first_error = next((line for line in lines if "error" in line.lower()), lines[-1])
            return f"building the CPU kernels failed: {first_error.strip()}"
    log.info("loaded the AVX-512 BF16 CPU kernels")
    return None


def load() -> bool:
    return _build() is None


def unavailable_reason() -> str | None:
    return _build()


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.kunlun_cpu.linear_bf16(x, weight, bias)


def linear_int8(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.kunlun_cpu.linear_int8(x, weight, scales, bias)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for contiguous FP32 [S, V] logits, in one AVX-512 pass
    per row (torch's reduction took 133 µs for one 49,152-entry row here)."""
    return torch.ops.kunlun_cpu.argmax_rows(logits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.kunlun_cpu.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta rounded to BF16, its RMSNorm) in one pass."""
    return torch.ops.kunlun_cpu.add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) for gate_up = [gate | up] along the last dimension."""
    return torch.ops.kunlun_cpu.silu_mul(gate_up)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Rotary, KV write and paged attention for one new token per sequence (see decode_ops.cpp)."""
    return torch.ops.kunlun_cpu.decode_attention(
        q, k, v, cos, sin, k_blocks, v_blocks, block_tables, context_lens, scale, window
    )


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q and k and the K/V write into the paged cache for any number of tokens;
    returns (rotated q, rotated k) (see decode_ops.cpp)."""
    return torch.ops.kunlun_cpu.rotary_kv_write(
        q, k, v, cos, sin, k_blocks, v_blocks, slot_block_ids, slot_offsets
    )


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[torch.Tensor],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shape: tuple[int, int, int],
    eps: float,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Every decoder layer of a decode step in one call (see decode_layers.cpp for ``weights``);
    ``shape`` is (num_heads, num_kv_heads, head_dim)."""
    return torch.ops.kunlun_cpu.decode_layers(
        x, cos, sin, weights, k_caches, v_caches, block_tables, context_lens, *shape, eps, scale, window
    )


def main(argv: list[str] | None = None) -> int:
    """``--build-to FILE``: compile the library (the CPU need not have AVX-512) and copy it there."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--build-to", type=Path, required=True)
    args = parser.parse_args(argv)
    args.build_to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_compile(), args.build_to)
    print(f"built {args.build_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
