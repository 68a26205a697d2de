"""Compiling and loading one kernel library, and what this process says while it compiles.

``cpu_kernels`` decides which tier's library to load from where; this module does it: torch's
extension builder (ninja and the local C++ compiler) into ``$TORCH_EXTENSIONS_DIR``, and
``torch.ops.load_library`` with the loader's own error kept (the missing symbol, the bad header).

A first start without prebuilt libraries compiles, which takes minutes on a small machine. While
it runs, ``current_build()`` answers what is being built, for which tier, where it is cached and
how far it got, so that the log and the server's 503 answers say so instead of a bare "loading".
Progress is counted from the object files the build leaves in its directory, one per source. The
build is per process (a library is loaded once into ``torch.ops``), so its progress is too: one
module-level slot, written only by ``building``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PROGRESS_LOG_SECONDS = 15.0  # how often the log repeats the progress of a build under way


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One tier's library being compiled: what, where, since when."""

    tier: str  # "avx512", "avx2"
    build_dir: Path  # where the compiler writes, and where later starts find the library
    source_names: tuple[str, ...]  # the C++ sources' file names
    started_at: float  # time.monotonic() when the build began

    @property
    def num_sources(self) -> int:
        return len(self.source_names)

    def num_compiled(self) -> int:
        """How many sources have their object file in the build directory so far."""
        return sum((self.build_dir / f"{Path(name).stem}.o").exists() for name in self.source_names)

    def describe(self, now: float | None = None) -> str:
        """One sentence for the log and the 503 answers: what, for which tier, once, progress."""
        elapsed = (time.monotonic() if now is None else now) - self.started_at
        return (
            f"building the {self.tier} CPU kernels for this machine (first start only: later starts "
            f"load the library cached in {self.build_dir}): {self.num_compiled()} of "
            f"{self.num_sources} C++ sources compiled, {elapsed:.0f} s so far"
        )


_lock = threading.Lock()
_current: KernelBuild | None = None


def current_build() -> KernelBuild | None:
    """The build under way in this process, or None."""
    with _lock:
        return _current


@contextmanager
def building(
    tier: str,
    build_dir: Path,
    source_names: tuple[str, ...],
    progress_log_seconds: float = PROGRESS_LOG_SECONDS,
) -> Iterator[KernelBuild]:
    """Marks a build as under way for its duration: ``current_build()`` answers it, and a daemon
    thread logs its progress every ``progress_log_seconds`` until the block ends."""
    global _current
    build = KernelBuild(tier, build_dir, source_names, time.monotonic())
    with _lock:
        _current = build
    log.info(
        "first start on this machine: building the %s CPU kernels (%d C++ sources) with the local "
        "compiler; this happens once (cached in %s) and can take minutes; prebuilt libraries in "
        "$KUNLUN_CPU_KERNELS_DIR (the runtime image has them) skip it",
        tier,
        build.num_sources,
        build_dir,
    )
    done = threading.Event()
    reporter = threading.Thread(
        target=_report, args=(build, done, progress_log_seconds), name="kernel-build-progress", daemon=True
    )
    reporter.start()
    try:
        yield build
        log.info(
            "built the %s CPU kernels in %.0f s; later starts load them from %s",
            tier,
            time.monotonic() - build.started_at,
            build_dir,
        )
    finally:
        done.set()
        reporter.join()
        with _lock:
            _current = None


def _report(build: KernelBuild, done: threading.Event, interval_seconds: float) -> None:
    while not done.wait(interval_seconds):
        log.info("%s", build.describe())


def load_library(path: Path) -> str | None:
    """Loads a library into ``torch.ops``; returns None, or why it did not load (torch keeps the
    loader's message, e.g. ``undefined symbol: ...``, in the exception's cause)."""
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as exc:
        return str(exc.__cause__ or exc)
    return None


def first_error_line(text: str) -> str:
    """The line of a build's output that says what went wrong: the compiler's first diagnostic
    (``file:line: error: ...``), else the first line naming an error, else the last line (without a
    closing full stop: it goes on inside a sentence)."""
    lines = [line.strip().rstrip(".") for line in text.strip().splitlines() if line.strip()] or [text]
    for marker in ("error:", "error"):
        found = next((line for line in lines if marker in line.lower()), None)
        if found is not None:
            return found
    return lines[-1]


def cached_library(name: str) -> Path:
    """Where a compile of the library ``name`` leaves it: torch's extension root (as
    ``cpp_extension._get_build_directory`` finds it, without creating anything, so a read-only
    ``--version`` can ask), then the library's own directory."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils import cpp_extension

        accelerator = "cpu"
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name / f"{name}.so"


def compile_and_load(name: str, sources: list[str], cflags: list[str]) -> None:
    """Compiles (or finds up to date) and loads the library ``name``. Raises what the build raises."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def compile_only(name: str, sources: list[str], cflags: list[str]) -> Path:
    """Compiles the library ``name`` without loading it (loading runs its static initialisers,
    compiled with the tier's instructions, which a build host below the tier cannot execute);
    returns its path."""
    from torch.utils import cpp_extension

    library = cached_library(name)
    library.parent.mkdir(parents=True, exist_ok=True)
    cpp_extension._write_ninja_file_and_build_library(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=[],
        extra_sycl_cflags=[],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[],
        build_directory=str(library.parent),
        verbose=False,
        with_cuda=False,
        with_sycl=False,
    )
    return library
