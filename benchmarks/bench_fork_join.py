"""What one ``at::parallel_for`` region costs on this CPU, beyond the work it shares out.

A decode step through ``kunlun_cpu::decode_layers`` opens about seven parallel regions per layer
(the four linears, decode attention's two passes, SiLU·up); a persistent thread team across the
layer stack would replace each fork/join with a barrier. This measures what is at stake: the
same work run N times, once split over ``--threads`` threads in a region per repetition and once
by one thread, and an empty region. The per-region overhead is (region time) − (work time ÷
threads).

    .venv/bin/python benchmarks/bench_fork_join.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
from pathlib import Path

import torch

SOURCE = r"""
#include <ATen/Parallel.h>
#include <atomic>
#include <chrono>

namespace {
// Integer work the compiler cannot fold away: `work` iterations per share.
int64_t spin(int64_t work, int64_t seed) {
  int64_t acc = seed;
  for (int64_t j = 0; j < work; ++j) acc = acc * 6364136223846793005LL + j;
  return acc;
}
}  // namespace

// Plain C entry points, called through ctypes: no pybind11 or torch/extension.h to compile, which
// took most of a minute on a 2-core machine where ATen/Parallel.h alone takes seconds.
extern "C" {

// Seconds per region: `regions` regions, each splitting `threads` shares of `work` iterations.
double in_regions(int64_t regions, int64_t threads, int64_t work) {
  std::atomic<int64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < regions; ++r) {
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t share = begin; share < end; ++share) sink += spin(work, share + r);
    });
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / regions;
}

// Seconds per share of the same work on the calling thread alone.
double serial(int64_t shares, int64_t work) {
  std::atomic<int64_t> sink{0};
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < shares; ++s) sink += spin(work, s);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / shares;
}

}  // extern "C"
"""


def build():
    """The library above, compiled once into the temporary directory (later runs find it built),
    loaded with ctypes."""
    from torch.utils import cpp_extension

    directory = Path(tempfile.gettempdir()) / "kunlun-bench-fork-join"
    directory.mkdir(exist_ok=True)
    source = directory / "fork_join.cpp"
    # Rewritten only when it changed, so that ninja finds the library up to date otherwise.
    if not source.exists() or source.read_text() != SOURCE:
        source.write_text(SOURCE)
    library = cpp_extension.load(
        "kunlun_bench_fork_join",
        sources=[str(source)],
        extra_cflags=["-O2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    module = ctypes.CDLL(str(library))
    module.in_regions.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    module.in_regions.restype = ctypes.c_double
    module.serial.argtypes = [ctypes.c_int64, ctypes.c_int64]
    module.serial.restype = ctypes.c_double
    return module


def measure(module, threads: int, work: int, regions: int, reps: int) -> dict:
    rows = []
    module.in_regions(10, threads, 0)  # the thread team is created by the first region: not timed
    for _ in range(reps):
        empty = module.in_regions(regions, threads, 0)
        region = module.in_regions(regions, threads, work)
        share = module.serial(regions, work)
        rows.append({"empty_region_s": empty, "region_s": region, "share_s": share})
    best = {key: min(row[key] for row in rows) for key in rows[0]}
    best["overhead_s"] = best["region_s"] - best["share_s"]
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=int, default=8000, help="iterations per thread per region")
    parser.add_argument("--regions", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(build(), args.threads, args.work, args.regions, args.reps)
    result["threads"] = args.threads
    print(
        f"{args.threads} threads: empty region {result['empty_region_s'] * 1e6:.2f} us; a region whose"
        f" threads each do {result['share_s'] * 1e6:.2f} us of work takes {result['region_s'] * 1e6:.2f} us:"
        f" {result['overhead_s'] * 1e6:.2f} us per region beyond the work (best of {args.reps})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
