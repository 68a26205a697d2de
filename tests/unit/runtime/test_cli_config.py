"""``--config FILE`` (e.g. the output of ``kunlun-runtime tune``) fills the engine flags left at
their defaults; flags given on the command line win; ``python -m kunlun_runtime`` runs the CLI."""

import subprocess
import sys

import pytest

from kunlun_runtime.commands.cli import build_parser
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.flags import engine_config_from_args


def parse(*argv):
    return engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x", *argv]))


def test_config_file_fills_defaults_and_explicit_flags_win(tmp_path):
    path = tmp_path / "tuned.yaml"
    path.write_text("engine:\n  block_size: 32\n  max_num_seqs: 7\n  kv_cache_memory: 64MiB\nwhy: {}\n")
    config = parse("--config", str(path), "--max-num-seqs", "3")
    assert (config.block_size, config.max_num_seqs, config.kv_cache_memory_bytes) == (32, 3, 64 << 20)
    assert parse().block_size == 16


def test_bad_config_file_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  block_size: 12\n")
    with pytest.raises(ConfigError, match="block_size"):
        parse("--config", str(path))


def test_python_dash_m_runs_every_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "kunlun_runtime", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for name in ("serve", "generate", "golden", "quantize", "preflight"):
        assert name in result.stdout
