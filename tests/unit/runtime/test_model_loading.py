"""Model directories: both config dialects, clear errors for bad architectures and broken files."""

import json
import shutil

import pytest

from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.models.model_config import parse_model_config
from kunlun_runtime.models.weights import iter_weights
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_old_and_new_rope_dialects_parse_to_the_same_rope():
    old = parse_model_config(
        {
            **BASE,
            "rope_theta": 5e5,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
        }
    )
    new = parse_model_config(
        {
            **BASE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert old.rope == new.rope
    assert (old.rope.theta, old.rope.rope_type, old.rope.factor) == (5e5, "llama3", 8.0)


def test_head_dim_is_derived_when_absent_and_kv_heads_default_to_heads():
    config = parse_model_config(BASE)
    assert (config.head_dim, config.num_kv_heads, config.qk_norm, config.attention_bias) == (
        16,
        4,
        False,
        False,
    )


def test_qwen_variants_get_bias_and_qk_norm():
    assert parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    assert parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"]}).qk_norm


def test_unknown_architecture_names_it_and_the_supported_list():
    with pytest.raises(
        ModelLoadError, match=r"'GPT2LMHeadModel'; supported: LlamaForCausalLM, MistralForCausalLM"
    ):
        parse_model_config({**BASE, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_type_is_refused():
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        parse_model_config({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_missing_field_is_named():
    config = dict(BASE)
    del config["hidden_size"]
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        parse_model_config(config)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TINY_SPECS["llama-gqa"])


def test_truncated_safetensors_file_is_named(tiny_dir, tmp_path):
    broken = shutil.copytree(tiny_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated safetensors file"):
        list(iter_weights(broken))


def test_missing_shard_listed_in_the_index_is_named(tiny_dir, tmp_path):
    broken = shutil.copytree(tiny_dir, tmp_path / "sharded")
    (broken / "model.safetensors").rename(broken / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ModelLoadError, match=r"model-00002-of-00002\.safetensors: weight file listed .* is missing"
    ):
        list(iter_weights(broken))
