"""Engine options: memory sizes and validation naming the option."""

import pytest

from kunlun_runtime.config import EngineConfig, parse_memory
from kunlun_runtime.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [("1024", 1024), ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 * 10**9), ("1.5KiB", 1536), (77, 77)],
)
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize("text", ["lots", "-1", "0", "4XB"])
def test_parse_memory_rejects_garbage(text):
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        parse_memory(text)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "int4"}, "dtype"),
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"quantization": "fp4"}, "quantization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_options_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as error:
        EngineConfig(**kwargs).validate()
    assert error.value.field == field
