"""Rebuild a Hugging Face ``tokenizer.json`` from the tokenizer metadata of a GGUF file.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the BPE
merges, a type per token (normal, control, user-defined, ...), the special token ids, the chat
template, and the *name* of the pre-tokenizer (``tokenizer.ggml.pre``) under which the merges were
learned. This module turns those into a ``tokenizers.Tokenizer`` and the ``tokenizer_config.json``
dict. It owns nothing else: reading the file and writing the directory belong to ``gguf_import``.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``, the kind Llama 3 and SmolLM ship) is
rebuilt; any other tokenizer model or an unknown pre-tokenizer name is refused with a
``ModelLoadError`` rather than guessed, because a wrong split silently changes token ids.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kunlun_runtime.errors import ModelLoadError

# llama.cpp's token types (``tokenizer.ggml.token_type``).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizers, named as in ``tokenizer.ggml.pre``. The facts (which regexes llama.cpp applies
# for which name) come from llama.cpp's vocabulary code; the GPT-2 regex is the one the
# ``ByteLevel`` pre-tokenizer applies by itself.
_GPT2_NAMES = frozenset({"default", "gpt2", "mpt", "olmo", "jais"})
_DIGITS_THEN_GPT2_NAMES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe"})
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_GPT2_NAMES | _DIGITS_THEN_GPT2_NAMES | _LLAMA3_NAMES))


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """The tokenizer facts read from a GGUF file (ids are indices into ``tokens``)."""

    tokens: Sequence[str]  # the vocabulary, id order, byte-level spelling for normal tokens
    merges: Sequence[str]  # "left right", best first
    token_types: Sequence[int] | None  # llama.cpp token type per id; None when the file has none
    pre_tokenizer: str | None  # ``tokenizer.ggml.pre``; None when absent (treated as "default")
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def build_pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for ``tokenizer.ggml.pre`` = ``name``.

    Raises:
        ModelLoadError: the name is not one we can reproduce exactly.
    """
    name = name or "default"
    if name in _GPT2_NAMES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _DIGITS_THEN_GPT2_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if name in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre) is not supported; "
        f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )


def _parse_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    pairs = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ModelLoadError(f"GGUF merge #{index} {merge!r} is not two tokens separated by one space")
        pairs.append((parts[0], parts[1]))
    return pairs


def _post_processor(vocab: GgufVocab) -> processors.PostProcessor:
    """Prepend BOS / append EOS exactly when the file asks for it."""
    ends = [
        ("bos", vocab.bos_token_id, vocab.add_bos_token),
        ("eos", vocab.eos_token_id, vocab.add_eos_token),
    ]
    for which, token_id, wanted in ends:
        if wanted and token_id is None:
            raise ModelLoadError(f"GGUF asks to add the {which} token but names no {which} token id")
    specials = {
        which: (vocab.tokens[token_id], token_id)
        for which, token_id, wanted in ends
        if wanted and token_id is not None  # wanted implies an id (checked above)
    }
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    bos = [f"{specials['bos'][0]}:0"] if "bos" in specials else []
    eos = [f"{specials['eos'][0]}:0"] if "eos" in specials else []
    return processors.TemplateProcessing(
        single=[*bos, "$A:0", *eos],
        pair=[*bos, "$A:0", *eos, *[t.replace(":0", ":1") for t in bos], "$B:1", *eos],
        special_tokens=list(specials.values()),
    )


def build_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """A byte-level BPE ``Tokenizer`` equal in behaviour to the GGUF's own tokenizer.

    Control tokens (``<|im_start|>``, ...) become special added tokens and user-defined tokens
    plain added tokens, so that both are matched whole in the text instead of being split.

    Raises:
        ModelLoadError: malformed merges, an unsupported pre-tokenizer, duplicate tokens.
    """
    token_to_id = {token: token_id for token_id, token in enumerate(vocab.tokens)}
    if len(token_to_id) != len(vocab.tokens):
        raise ModelLoadError("GGUF vocabulary lists the same token twice; cannot build a BPE vocabulary")
    tokenizer = Tokenizer(models.BPE(vocab=token_to_id, merges=_parse_merges(vocab.merges), fuse_unk=False))
    tokenizer.pre_tokenizer = build_pre_tokenizer(vocab.pre_tokenizer)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(vocab)
    types = vocab.token_types or ()
    control = [t for t, kind in zip(vocab.tokens, types, strict=False) if kind == TOKEN_TYPE_CONTROL]
    user = [t for t, kind in zip(vocab.tokens, types, strict=False) if kind == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def _token_or_none(vocab: GgufVocab, token_id: int | None) -> str | None:
    return vocab.tokens[token_id] if token_id is not None else None


def build_tokenizer_config(vocab: GgufVocab, *, model_max_length: int) -> dict[str, object]:
    """The ``tokenizer_config.json`` dict: special tokens, BOS/EOS flags, the chat template."""
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token_or_none(vocab, vocab.bos_token_id),
        "eos_token": _token_or_none(vocab, vocab.eos_token_id),
        "unk_token": _token_or_none(vocab, vocab.unk_token_id),
        "pad_token": _token_or_none(vocab, vocab.pad_token_id),
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if vocab.chat_template is not None:
        config["chat_template"] = vocab.chat_template
    return config


def _optional_id(metadata: Mapping[str, Any], key: str, num_tokens: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < num_tokens:
        raise ModelLoadError(f"GGUF {key} = {value!r} is not a token id of the {num_tokens}-token vocabulary")
    return value


def read_gguf_vocab(metadata: Mapping[str, Any]) -> GgufVocab:
    """The tokenizer facts from a GGUF's metadata (keys as in the file, values already decoded).

    Raises:
        ModelLoadError: the file has no byte-level BPE tokenizer, or its ids are out of range.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
            "only byte-level BPE ('gpt2', as in Llama 3 and SmolLM) can be rebuilt"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ModelLoadError("GGUF has no tokenizer.ggml.tokens or .merges to build a tokenizer from")
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None and len(token_types) != len(tokens):
        raise ModelLoadError(f"GGUF has {len(token_types)} token types for {len(tokens)} tokens")
    ids = {
        name: _optional_id(metadata, f"tokenizer.ggml.{name}_token_id", len(tokens))
        for name in ("bos", "eos", "unknown", "padding")
    }
    return GgufVocab(
        tokens=tokens,
        merges=merges,
        token_types=token_types,
        pre_tokenizer=metadata.get("tokenizer.ggml.pre"),
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        unk_token_id=ids["unknown"],
        pad_token_id=ids["padding"],
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
