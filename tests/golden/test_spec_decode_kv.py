"""Speculative decoding and the paged KV cache: the blocks a step makes for drafts that are then
rejected go back to the pool at once, and a request never holds more blocks than its tokens need."""

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.engine import spec_decode

SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[(31 * i + 7 * k) % 250 + 3 for i in range(9 + 5 * k)] for k in range(3)]


def test_rejected_drafts_give_their_blocks_back(tiny_model_dirs, monkeypatch):
    # Every request drafts six copies of one token each step: most are rejected, and with blocks
    # of 8 tokens the room made for them often spans a block the request does not yet need.
    monkeypatch.setattr(
        spec_decode, "draft_rows_worth_running", lambda cost, decoding, chances, measured=None: len(chances)
    )
    monkeypatch.setattr(spec_decode.Proposer, "allowance", lambda self, request, room: min(6, max(room, 0)))
    monkeypatch.setattr(spec_decode.Proposer, "drafts", lambda self, request, k: [5] * k)
    options = {"dtype": "float32", "max_model_len": 128, "block_size": 8}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    model_dir = str(tiny_model_dirs["llama-gqa"])
    plain = [o.outputs[0].token_ids for o in LLM(model_dir, **options).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params
    )]  # fmt: skip
    llm = LLM(model_dir, speculative_config=SPEC, **options)
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    held_past_need = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)
        for request in engine.scheduler.running:
            need = -(-request.num_tokens // 8)
            held_past_need += len(engine.kv.block_ids(request.request_id)) > need
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == plain
    assert (
        engine.spec.counters.num_draft_tokens > engine.spec.counters.num_accepted_tokens
    )  # rejections happened
    assert held_past_need == 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
