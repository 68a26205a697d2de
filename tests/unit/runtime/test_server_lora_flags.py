"""LoRA flags, vLLM's names and forms: ``--enable-lora`` and the limits onto EngineConfig (and from a
``--config`` file), ``--lora-modules`` in both forms, ``--allow-runtime-lora-updating`` or vLLM's
environment variable, and every error naming the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kunlun_runtime.commands.cli import build_parser
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.flags import engine_config_from_args
from kunlun_runtime.options.lora import (
    ALLOW_RUNTIME_LORA_UPDATING_ENV,
    LoRAModule,
    LoRAServeOptions,
    lora_serve_options,
    parse_lora_module,
)
from kunlun_runtime.server.cli import run_serve


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_options(*argv: str, env: dict[str, str] | None = None) -> LoRAServeOptions:
    args = serve_args(*argv)
    return lora_serve_options(args, engine_config_from_args(args), env or {})


def test_the_engine_flags_map_onto_engine_config_with_vllm_defaults() -> None:
    default = engine_config_from_args(serve_args())
    assert (default.enable_lora, default.max_loras, default.max_lora_rank, default.max_cpu_loras) == (
        False,
        1,
        16,
        None,
    )
    config = engine_config_from_args(
        serve_args("--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8")
    )
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (
        True,
        4,
        64,
        8,
    )


def test_an_impossible_limit_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError) as error:
        engine_config_from_args(serve_args("--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"))
    assert error.value.field == "max_cpu_loras"


def test_a_config_file_sets_the_limits_by_the_same_names(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("enable_lora: true\nmax-loras: 3\nmax_lora_rank: 32\n")
    args = serve_args("--config", str(path), "--max-lora-rank", "8", "--lora-modules", "sql=/a/sql")
    config = engine_config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 8)
    # --lora-modules is checked against the merged config: the file enabled LoRA.
    assert lora_serve_options(args, config, {}).modules == (LoRAModule("sql", "/a/sql"),)
    path.write_text("enable_lora: 1\n")
    with pytest.raises(ConfigError, match="enable_lora: must be bool"):
        engine_config_from_args(serve_args("--config", str(path)))


def test_modules_in_both_forms_several_values_and_repeated_keep_their_order() -> None:
    options = serve_options(
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        '{"name": "tone", "path": "/adapters/tone", "base_model_name": "base"}',
        "--lora-modules",
        "a=b=c",
    )
    assert options.modules == (
        LoRAModule("sql", "/adapters/sql"),
        LoRAModule("tone", "/adapters/tone", "base"),
        LoRAModule("a", "b=c"),
    )
    assert not options.allow_runtime_updating


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('{"name": "x", "path": ', "not valid JSON"),
        ('{"name": "x", "path": "/p", "rank": 8}', "unknown key 'rank'"),
        ('{"name": "x"}', "needs a non-empty path"),
        ('{"name": "x", "path": "/p", "base_model_name": 3}', "base_model_name must be a non-empty string"),
        ("just-a-name", "expected name=path or a JSON object"),
        ("=/p", "must be a non-empty string"),
        ("x=", "needs a non-empty path"),
        ("a,b=/p", "contains ','"),
    ],
)
def test_a_bad_module_is_an_error_naming_the_flag(value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as error:
        parse_lora_module(value)
    assert str(error.value).startswith("--lora-modules: ")
    assert error.value.field == "--lora-modules"


def test_a_name_given_twice_is_an_error() -> None:
    with pytest.raises(ConfigError, match="'sql' given twice"):
        serve_options("--enable-lora", "--lora-modules", "sql=/a", '{"name": "sql", "path": "/b"}')


def test_adapters_and_runtime_loading_need_enable_lora() -> None:
    with pytest.raises(ConfigError, match="--lora-modules: serving adapters needs --enable-lora"):
        serve_options("--lora-modules", "sql=/a")
    with pytest.raises(ConfigError, match=r"--allow-runtime-lora-updating: .* needs --enable-lora"):
        serve_options("--allow-runtime-lora-updating")
    env = {ALLOW_RUNTIME_LORA_UPDATING_ENV: "true"}
    with pytest.raises(ConfigError, match=rf"\${ALLOW_RUNTIME_LORA_UPDATING_ENV}: .* needs --enable-lora"):
        serve_options(env=env)


def test_runtime_loading_comes_from_the_flag_else_vllms_environment_variable() -> None:
    assert serve_options("--enable-lora", "--allow-runtime-lora-updating").allow_runtime_updating
    assert serve_options(
        "--enable-lora", env={ALLOW_RUNTIME_LORA_UPDATING_ENV: "True"}
    ).allow_runtime_updating
    assert not serve_options(
        "--enable-lora", env={ALLOW_RUNTIME_LORA_UPDATING_ENV: "0"}
    ).allow_runtime_updating
    off = serve_options(
        "--enable-lora", "--no-allow-runtime-lora-updating", env={ALLOW_RUNTIME_LORA_UPDATING_ENV: "1"}
    )
    assert not off.allow_runtime_updating
    with pytest.raises(ConfigError, match=ALLOW_RUNTIME_LORA_UPDATING_ENV) as error:
        serve_options("--enable-lora", env={ALLOW_RUNTIME_LORA_UPDATING_ENV: "maybe"})
    assert error.value.field == ALLOW_RUNTIME_LORA_UPDATING_ENV


def test_serve_refuses_adapters_without_enable_lora_before_loading_anything() -> None:
    with pytest.raises(SystemExit, match="--lora-modules: serving adapters needs --enable-lora"):
        run_serve(serve_args("--lora-modules", "sql=/nowhere"))
