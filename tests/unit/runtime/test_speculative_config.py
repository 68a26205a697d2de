"""--speculative-config's two methods: each method's defaults where a key is left out, its ranges,
and the other method's keys refused, every error naming ``speculative_config.<key>``."""

import dataclasses

import pytest

from kunlun_runtime.config import EngineConfig, SpeculativeConfig, parse_speculative_config
from kunlun_runtime.errors import ConfigError


def test_each_method_takes_its_own_defaults():
    ngram = parse_speculative_config('{"method": "ngram"}')
    suffix = parse_speculative_config('{"method": "suffix"}')
    assert ngram == SpeculativeConfig("ngram", 3, 4, 1)
    assert suffix == SpeculativeConfig(
        "suffix",
        num_speculative_tokens=24,
        suffix_decoding_max_tree_depth=24,
        suffix_decoding_max_cached_requests=10000,
        suffix_decoding_max_spec_factor=1.0,
        suffix_decoding_min_token_prob=0.1,
    )
    assert (ngram.suffix_decoding_max_tree_depth, suffix.prompt_lookup_max) == (None, None)
    assert parse_speculative_config("{}") == ngram  # ngram is the default method


def test_a_good_suffix_config_parses():
    config = parse_speculative_config(
        {
            "method": "suffix",
            "num_speculative_tokens": 32,
            "suffix_decoding_max_tree_depth": 64,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0,
        }
    )
    assert config is not None
    assert (
        config.num_speculative_tokens,
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    ) == (32, 64, 0, 2, 0)


@pytest.mark.parametrize(
    ("value", "key", "message"),
    [
        ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max", "applies to method ngram only"),
        (
            {"method": "ngram", "suffix_decoding_max_tree_depth": 8},
            "suffix_decoding_max_tree_depth",
            "method suffix only",
        ),
        ({"suffix_decoding_min_token_prob": 0.5}, "suffix_decoding_min_token_prob", "method suffix only"),
        ({"method": "suffix", "num_speculative_tokens": 33}, "num_speculative_tokens", r"in \[1, 32\]"),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 0},
            "suffix_decoding_max_tree_depth",
            r"in \[1, 64\]",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 65},
            "suffix_decoding_max_tree_depth",
            r"in \[1, 64\]",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_tree_depth": 8.0},
            "suffix_decoding_max_tree_depth",
            "integer",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_cached_requests": -1},
            "suffix_decoding_max_cached_requests",
            "integer >= 0",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": 0},
            "suffix_decoding_max_spec_factor",
            "> 0",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": True},
            "suffix_decoding_max_spec_factor",
            "> 0",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")},
            "suffix_decoding_max_spec_factor",
            "> 0",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 1.5},
            "suffix_decoding_min_token_prob",
            r"\[0, 1\]",
        ),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": "0.1"},
            "suffix_decoding_min_token_prob",
            r"\[0, 1\]",
        ),
        ({"method": "eagle"}, "method", r"one of \['ngram', 'suffix'\]"),
        ({"method": "suffix", "suffix_decoding_depth": 8}, "suffix_decoding_depth", "unknown key"),
    ],
)
def test_bad_keys_are_refused_by_name(value, key, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_speculative_config(value)
    assert error.value.field == f"speculative_config.{key}"


def test_the_engine_config_validates_a_constructed_one_too():
    bad = SpeculativeConfig("suffix", prompt_lookup_min=2)
    with pytest.raises(ConfigError, match="applies to method ngram only") as error:
        EngineConfig(model="m", speculative_config=bad).validate()
    assert error.value.field == "speculative_config.prompt_lookup_min"


def test_replace_keeps_the_method_defaults():
    config = dataclasses.replace(parse_speculative_config('{"method": "suffix"}'), num_speculative_tokens=8)
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth) == (8, 24)
