"""Speculative decoding in the operator: ``spec.runtime.speculative`` refused by the CRD and the
parser alike (naming the field), the exact ``--speculative-config`` JSON in the pods of a Deployment
and of a LeaderWorkerSet, the rollout a change makes, the admission policy, and the runtime's own
parser taking what the operator builds."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kunlun_operator.builders.configmap import config_hash, runtime_args
from kunlun_operator.decide.reconcile import desired_objects
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.admission_policy import STRICTEST, check_policy
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec, SpeculativeSpec
from tests.unit.operator.crd_schema import validate_cr
from tests.unit.operator.factories import load_example, make_cr, make_facts, make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
DOC = Path(__file__).resolve().parents[3] / "docs" / "operator.md"
PATH = "spec.runtime.speculative"
NGRAM = {"method": "ngram", "numSpeculativeTokens": 5, "promptLookupMax": 8, "promptLookupMin": 3}
SUFFIX = {
    "method": "suffix",
    "numSpeculativeTokens": 32,
    "suffixDecodingMaxTreeDepth": 64,
    "suffixDecodingMaxCachedRequests": 0,
    "suffixDecodingMaxSpecFactor": 2,
    "suffixDecodingMinTokenProb": 0.25,
}


def _raw(speculative: dict[str, Any], **runtime: Any) -> dict[str, Any]:
    return make_raw_spec(runtime={**runtime, "speculative": speculative})


def _spec(speculative: dict[str, Any], **runtime: Any) -> InferenceSpec:
    return parse_spec(_raw(speculative, **runtime))


def _flag(args: list[str]) -> str:
    assert args.count("--speculative-config") == 1, args
    return args[args.index("--speculative-config") + 1]


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        (
            NGRAM,
            '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":8,"prompt_lookup_min":3}',
        ),
        (
            SUFFIX,
            '{"method":"suffix","num_speculative_tokens":32,"suffix_decoding_max_tree_depth":64,'
            '"suffix_decoding_max_cached_requests":0,"suffix_decoding_max_spec_factor":2.0,'
            '"suffix_decoding_min_token_prob":0.25}',
        ),
        ({}, '{"method":"ngram"}'),
        ({"method": "suffix", "numSpeculativeTokens": 12}, '{"method":"suffix","num_speculative_tokens":12}'),
    ],
    ids=["ngram, every key", "suffix, every key", "empty: method only", "suffix, one key"],
)
def test_the_pod_gets_vllms_snake_case_json_with_only_the_keys_set(
    speculative: dict[str, Any], expected: str
) -> None:
    spec = _spec(speculative)
    assert runtime_args(spec, "/models/m") == [
        "serve", "--model", "/models/m", "--served-model-name", "qwen", "--port", "8000",
        "--dtype", "auto", "--tensor-parallel-size", "1", "--speculative-config", expected,
    ]  # fmt: skip


def test_off_without_the_field() -> None:
    spec = parse_spec(make_raw_spec())
    assert spec.runtime.speculative is None
    assert "--speculative-config" not in runtime_args(spec, "/models/m")


def test_the_configmap_holds_the_flag_and_a_change_rolls_the_pods() -> None:
    def workload(speculative: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = parse_spec(make_raw_spec() if speculative is None else _raw(speculative))
        objects, _ = desired_objects(make_ref(), spec, make_facts(), IMAGE, replicas=1)
        by_kind = {o["kind"]: o for o in objects}
        return by_kind["ConfigMap"], by_kind["Deployment"]

    (off_config, off), (three_config, three), (five_config, five) = (
        workload(None),
        workload({"numSpeculativeTokens": 3}),
        workload({"numSpeculativeTokens": 5}),
    )
    assert (
        'speculative-config: \'{"method":"ngram","num_speculative_tokens":3}\'\n'
        in (three_config["data"]["config.yaml"])
    )
    hashes = {config_hash(c["data"]) for c in (off_config, three_config, five_config)}
    assert len(hashes) == 3
    templates = [d["spec"]["template"] for d in (off, three, five)]
    assert templates[0] != templates[1] != templates[2] != templates[0]
    assert _flag(five["spec"]["template"]["spec"]["containers"][0]["args"]) == (
        '{"method":"ngram","num_speculative_tokens":5}'
    )


def test_a_multi_node_group_runs_the_same_config_on_leader_and_workers() -> None:
    raw = _raw(NGRAM, tensorParallelSize=8, pipelineParallelSize=2)
    raw["resources"] = {"xpus": 8}
    objects, _ = desired_objects(
        make_ref(), parse_spec(raw), make_facts(leaderworkerset_served=True), IMAGE, replicas=1
    )
    (lws,) = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    flags = {
        role: _flag(template[role]["spec"]["containers"][0]["args"])
        for role in ("leaderTemplate", "workerTemplate")
    }
    expected = '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":8,"prompt_lookup_min":3}'
    assert flags == {"leaderTemplate": expected, "workerTemplate": expected}


@pytest.mark.parametrize("speculative", [NGRAM, SUFFIX, {}, {"method": "suffix"}, {"promptLookupMin": 4}])
def test_good_specs_pass_the_crd_and_parse_the_same_with_and_without_its_defaults(
    speculative: dict[str, Any],
) -> None:
    defaulted, problems = validate_cr(make_cr(_raw(speculative)))
    assert problems == []
    assert defaulted["spec"]["runtime"]["speculative"]["method"] == speculative.get("method", "ngram")
    assert parse_spec(defaulted["spec"]) == parse_spec(_raw(speculative))


def test_the_parsed_values_keep_numbers_as_floats() -> None:
    assert _spec(SUFFIX).runtime.speculative == SpeculativeSpec(
        method="suffix",
        num_speculative_tokens=32,
        suffix_decoding_max_tree_depth=64,
        suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=2.0,
        suffix_decoding_min_token_prob=0.25,
    )


BAD = [
    ("unknown method", {"method": "eagle"}, "method"),
    ("zero tokens", {"numSpeculativeTokens": 0}, "numSpeculativeTokens"),
    ("33 tokens", {"numSpeculativeTokens": 33}, "numSpeculativeTokens"),
    ("tokens not an integer", {"numSpeculativeTokens": 2.5}, "numSpeculativeTokens"),
    ("lookup max 33", {"promptLookupMax": 33}, "promptLookupMax"),
    ("lookup min 0", {"promptLookupMin": 0}, "promptLookupMin"),
    ("min above max", {"promptLookupMin": 5, "promptLookupMax": 3}, "promptLookupMin"),
    ("min above the default max", {"promptLookupMin": 5}, "promptLookupMin"),
    ("ngram key under suffix", {"method": "suffix", "promptLookupMax": 4}, "promptLookupMax"),
    ("ngram min under suffix", {"method": "suffix", "promptLookupMin": 2}, "promptLookupMin"),
    ("suffix key under ngram", {"suffixDecodingMaxTreeDepth": 8}, "suffixDecodingMaxTreeDepth"),
    (
        "suffix cache under ngram",
        {"method": "ngram", "suffixDecodingMaxCachedRequests": 10},
        "suffixDecodingMaxCachedRequests",
    ),
    ("spec factor under ngram", {"suffixDecodingMaxSpecFactor": 1.0}, "suffixDecodingMaxSpecFactor"),
    ("token prob under ngram", {"suffixDecodingMinTokenProb": 0.5}, "suffixDecodingMinTokenProb"),
    ("tree depth 65", {"method": "suffix", "suffixDecodingMaxTreeDepth": 65}, "suffixDecodingMaxTreeDepth"),
    (
        "negative cache",
        {"method": "suffix", "suffixDecodingMaxCachedRequests": -1},
        "suffixDecodingMaxCachedRequests",
    ),
    ("spec factor 0", {"method": "suffix", "suffixDecodingMaxSpecFactor": 0}, "suffixDecodingMaxSpecFactor"),
    (
        "token prob above 1",
        {"method": "suffix", "suffixDecodingMinTokenProb": 1.5},
        "suffixDecodingMinTokenProb",
    ),
    (
        "token prob a string",
        {"method": "suffix", "suffixDecodingMinTokenProb": "high"},
        "suffixDecodingMinTokenProb",
    ),
    ("unknown field", {"prompt_lookup_max": 4}, ""),
]


@pytest.mark.parametrize(("what", "speculative", "field"), BAD, ids=[case[0] for case in BAD])
def test_bad_specs_are_refused_by_the_crd_and_the_operator_naming_the_field(
    what: str, speculative: dict[str, Any], field: str
) -> None:
    path = f"{PATH}.{field}" if field else PATH  # the CRD names an unknown field's parent
    _, problems = validate_cr(make_cr(_raw(speculative)))
    assert problems, what
    assert {p.path for p in problems} == {path}, problems
    with pytest.raises(SpecError) as raised:
        parse_spec(_raw(speculative))
    assert raised.value.field == (path if field else f"{PATH}.prompt_lookup_max"), raised.value


def test_the_error_says_which_method_a_key_belongs_to() -> None:
    _, problems = validate_cr(make_cr(_raw({"method": "suffix", "promptLookupMax": 4})))
    assert [p.message for p in problems] == ["promptLookupMax applies to method ngram only"]
    with pytest.raises(SpecError, match=r"^spec\.runtime\.speculative\.suffixDecodingMinTokenProb: "):
        parse_spec(_raw({"suffixDecodingMinTokenProb": 0.5}))
    with pytest.raises(SpecError) as raised:
        parse_spec(_raw({"suffixDecodingMinTokenProb": 0.5}))
    assert raised.value.message == "applies to method suffix only, got method ngram"


def test_extra_args_may_not_set_the_flag_the_spec_owns() -> None:
    spec = parse_spec(make_raw_spec(runtime={"extraArgs": ["--speculative-config={}"]}))
    refused = check_policy(spec, STRICTEST)
    assert refused is not None and refused.field == "spec.runtime.extraArgs[0]"


def test_the_runtime_parses_the_config_the_operator_builds() -> None:
    from kunlun_runtime.config import SpeculativeConfig, parse_speculative_config

    example = parse_spec(load_example("kis-speculative.yaml")["spec"])
    parsed = parse_speculative_config(_flag(runtime_args(example, "/models/m")))
    assert parsed == SpeculativeConfig(
        method="ngram", num_speculative_tokens=5, prompt_lookup_max=8, prompt_lookup_min=3
    )
    assert json.loads(_flag(runtime_args(_spec({}), "/m"))) == {"method": "ngram"}
    assert parse_speculative_config(_flag(runtime_args(_spec({}), "/m"))) == SpeculativeConfig()


def test_the_runtime_parses_a_suffix_config_the_operator_builds() -> None:
    from kunlun_runtime import config as runtime_config

    parsed = runtime_config.parse_speculative_config(_flag(runtime_args(_spec(SUFFIX), "/m")))
    assert parsed is not None
    assert {key: value for key, value in dataclasses.asdict(parsed).items() if value is not None} == {
        "method": "suffix",
        "num_speculative_tokens": 32,
        "suffix_decoding_max_tree_depth": 64,
        "suffix_decoding_max_cached_requests": 0,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.25,
    }


def test_the_documented_flag_and_refusal_are_the_operators() -> None:
    """docs/operator.md "Speculative decoding": its example is examples/kis-speculative.yaml's, with
    the flag the builder makes of it and the operator's own refusal message."""
    section = DOC.read_text().split("## Speculative decoding\n", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert snippet is not None
    example = load_example("kis-speculative.yaml")["spec"]
    assert yaml.safe_load(snippet.group(1))["runtime"]["speculative"] == example["runtime"]["speculative"]
    flag = _flag(runtime_args(parse_spec(example), "/m"))
    assert f"`--speculative-config '{flag}'`" in section
    with pytest.raises(SpecError) as raised:
        parse_spec(_raw({"method": "suffix", "promptLookupMax": 4}))
    assert f"`{raised.value}`" in " ".join(section.split())
