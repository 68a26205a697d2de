"""Sampling: truncation rules, penalties, min_tokens, seeded reproducibility, logprobs."""

import math

import pytest
import torch

from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampler import Sampler, apply_penalties, truncate_distribution
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError


def make_request(request_id="r", params=None, prompt=(1, 2), output=()):
    params = params or SamplingParams()
    request = Request(request_id, list(prompt), params, max_total_tokens=100)
    request.output_token_ids = list(output)
    return request


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


def test_top_k_keeps_the_k_most_likely():
    probs = truncate_distribution(LOGITS.clone(), SamplingParams(top_k=2))
    assert probs.tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = truncate_distribution(LOGITS.clone(), SamplingParams(top_p=0.7))
    assert probs.tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs = truncate_distribution(LOGITS.clone(), SamplingParams(min_p=0.3))
    assert probs.tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])


def test_temperature_sharpens():
    probs = truncate_distribution(LOGITS.clone(), SamplingParams(temperature=0.5))
    expected = torch.tensor([0.25, 0.0625, 0.0225, 0.01])
    assert probs.tolist() == pytest.approx((expected / expected.sum()).tolist())


def test_penalties_follow_hf_repetition_and_openai_presence_frequency():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    request = make_request(params=params, prompt=[0], output=[1, 1, 2])
    out = apply_penalties(logits, [request])
    # token 0 (prompt): 2/2; token 1 (twice in output): -2*2 - 0.5 - 0.5; token 2: 1/2 - 0.5 - 0.25
    assert out.tolist() == [[1.0, -5.0, -0.25, 0.5]]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    sampler = Sampler(eos_token_ids=[0])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])
    assert sampler.sample(logits, [make_request(params=params)])[0][0] == 2
    assert sampler.sample(logits, [make_request(params=params, output=[5, 5])])[0][0] == 0


def test_a_batch_needing_only_argmax_gets_it_and_a_batch_mate_that_needs_more_gets_that():
    sampler = Sampler(eos_token_ids=[0])
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0], [0.0, 1.0, 7.0, 3.0]])
    before = logits.clone()
    greedy = SamplingParams(temperature=0)
    held = SamplingParams(temperature=0, min_tokens=1)  # no EOS before its first token
    penalised = SamplingParams(temperature=0, repetition_penalty=8.0)  # token 2 was in its prompt
    assert sampler.sample(logits, [make_request(params=greedy), make_request(params=greedy)]) == [
        (0, None),
        (2, None),
    ]
    both = sampler.sample(logits, [make_request(params=held), make_request(params=penalised, prompt=[2])])
    assert [token for token, _ in both] == [1, 3]
    assert torch.equal(logits, before)  # the caller's logits are never changed


def test_seeded_sampling_does_not_depend_on_batch_mates():
    row = torch.randn(50, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    sequence_alone = _draw_sequence(row, seeded, mates=False)
    sequence_batched = _draw_sequence(row, seeded, mates=True)
    assert sequence_alone == sequence_batched
    assert len(set(sequence_alone)) > 1  # it really samples


def _draw_sequence(row, params, mates):
    sampler = Sampler([], seed=7 if mates else 3)
    request = make_request("x", params)
    other = make_request("o", SamplingParams(temperature=1.0))
    out = []
    for _ in range(20):
        if mates:
            out.append(sampler.sample(torch.stack([row, row]), [other, request])[1][0])
        else:
            out.append(sampler.sample(row.unsqueeze(0), [request])[0][0])
    return out


def test_logprobs_are_raw_model_logprobs_with_rank_and_top():
    sampler = Sampler([])
    params = SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5)
    token, logprob = sampler.sample(LOGITS.clone().unsqueeze(0), [make_request(params=params, prompt=[3])])[0]
    assert token == 0
    assert logprob.logprob == pytest.approx(math.log(0.5))
    assert logprob.rank == 1
    assert [t for t, _ in logprob.top] == [0, 1]
    assert logprob.top[1][1] == pytest.approx(math.log(0.25))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field
    assert error.value.status_code == 400
    assert str(error.value).startswith(field)
