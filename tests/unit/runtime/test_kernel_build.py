"""What a kernel build says about itself: the build under way and its progress (from the object
files in its directory), the first error line of a failed build, the loader's own message, and
where the library is cached, found as torch finds it without creating anything."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kunlun_runtime.layers import kernel_build
from kunlun_runtime.layers.kernel_build import KernelBuild, building, current_build, first_error_line

SOURCES = ("linear.cpp", "decode_ops.cpp", "registration.cpp")


def test_progress_counts_the_object_files_of_the_sources(tmp_path: Path) -> None:
    build = KernelBuild("avx2", tmp_path / "kunlun_avx2_abc", SOURCES, started_at=100.0)
    assert build.num_compiled() == 0  # the directory does not exist yet
    build.build_dir.mkdir()
    (build.build_dir / "linear.o").touch()
    (build.build_dir / "decode_ops.o").touch()
    (build.build_dir / "build.ninja").touch()
    assert build.num_compiled() == 2
    assert build.describe(now=142.4) == (
        "building the avx2 CPU kernels for this machine (first start only: later starts load the "
        f"library cached in {build.build_dir}): 2 of 3 C++ sources compiled, 42 s so far"
    )


def test_a_build_is_current_while_it_runs_and_announced_once_done(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger=kernel_build.__name__)
    assert current_build() is None
    with building("avx512", tmp_path, SOURCES) as build:
        assert current_build() is build
    assert current_build() is None
    first, last = caplog.messages[0], caplog.messages[-1]
    assert first.startswith("first start on this machine: building the avx512 CPU kernels (3 C++ sources)")
    assert f"this happens once (cached in {tmp_path})" in first
    assert last.startswith("built the avx512 CPU kernels in ") and last.endswith(
        f"later starts load them from {tmp_path}"
    )


def test_a_failed_build_is_no_longer_current_and_not_announced_as_built(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger=kernel_build.__name__)
    with pytest.raises(RuntimeError), building("avx2", tmp_path, SOURCES):
        raise RuntimeError("ninja: build stopped")
    assert current_build() is None
    assert not [message for message in caplog.messages if message.startswith("built ")]


@pytest.mark.parametrize(
    ("output", "line"),
    [
        (
            "Error building extension 'kunlun_avx2_abc': [1/3] c++ -c linear.cpp\nFAILED: linear.o\n"
            "linear.cpp:12:5: error: 'foo' was not declared in this scope\nninja: build stopped",
            "linear.cpp:12:5: error: 'foo' was not declared in this scope",
        ),
        (
            "Command '['/bin/false', '--version']' returned non-zero exit status 1.",
            "Command '['/bin/false', '--version']' returned non-zero exit status 1",
        ),
        ("Ninja is required to load C++ extensions", None),
    ],
)
def test_the_first_error_line_is_the_compilers_diagnostic(output: str, line: str | None) -> None:
    assert first_error_line(output) == (line or output)


def test_a_library_that_does_not_load_gives_the_loaders_message(tmp_path: Path) -> None:
    library = tmp_path / "kunlun_avx2.so"
    library.write_bytes(b"not an ELF file")
    error = kernel_build.load_library(library)
    assert error is not None and error.startswith(str(library)) and "Could not load" not in error


@pytest.mark.parametrize("variable", ["TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"])
def test_the_cache_is_where_torch_builds_and_finding_it_creates_nothing(
    tmp_path: Path, monkeypatch, variable: str
) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv(variable, str(tmp_path / "cache"))  # XDG_CACHE_HOME: torch's default root under it
    found = kernel_build.cached_library("kunlun_probe_abc")
    assert not (tmp_path / "cache").exists()
    expected = Path(cpp_extension._get_build_directory("kunlun_probe_abc", verbose=False))
    assert found == expected / "kunlun_probe_abc.so" and found.is_relative_to(tmp_path / "cache")
