"""LoRA in the engine: bad adapters refused naming the problem with nothing disturbed, adapters in
the prefix-cache key and the KV events, at most max_loras adapters a step, the host cache."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kunlun_runtime import LLM, LoRARequest, SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.kv_events import BlockStored
from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.kv.prefix_hash import PrefixHasher
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import TINY_SPECS, make_tiny_model
from tests.unit.runtime.test_kv_manager import FakeRequest

PROMPT = [(13 * i) % 250 + 3 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = make_tiny_model(root / "base", TINY_SPECS["llama-gqa"])
    other = make_tiny_model(root / "other", TINY_SPECS["llama-head-dim"])
    return {
        "base": base,
        "a": make_adapter(base, root / "a", rank=8, seed=1),
        "b": make_adapter(base, root / "b", rank=4, seed=2),
        "r32": make_adapter(base, root / "r32", rank=32, seed=3),
        "other-model": make_adapter(other, root / "other-adapter", rank=8, seed=4),
        "root": root,
    }


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(
        str(dirs["base"]), dtype="float32", enable_lora=True, max_loras=2, max_model_len=128, block_size=8
    )


def tokens(llm, lora=None, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=lora)[0].outputs[0].token_ids


def all_free(llm):
    pool = llm.engine.block_pool
    return pool.num_free == pool.num_blocks and not llm.engine.has_unfinished_requests()


def broken_copy(dirs, name, edit):
    """A copy of adapter ``a`` with ``edit(config, tensors)`` applied."""
    target = dirs["root"] / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(dirs["a"], target)
    config = json.loads((target / "adapter_config.json").read_text())
    tensors = load_file(target / "adapter_model.safetensors")
    edit(config, tensors)
    (target / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, target / "adapter_model.safetensors")
    return target


def _rename_layer(tensors):
    for key in [k for k in tensors if ".layers.1." in k]:
        tensors[key.replace(".layers.1.", ".layers.5.")] = tensors.pop(key)


BAD = {
    "missing": (lambda dirs: dirs["root"] / "nowhere", "adapter_config.json not found"),
    "dora": (lambda d: broken_copy(d, "dora", lambda c, t: c.update(use_dora=True)), "use_dora: DoRA"),
    "bias": (lambda d: broken_copy(d, "bias", lambda c, t: c.update(bias="all")), "LoRA biases"),
    "saved-modules": (
        lambda d: broken_copy(d, "saved", lambda c, t: c.update(modules_to_save=["lm_head"])),
        "modules_to_save",
    ),
    "rank-above-limit": (lambda d: d["r32"], "rank 32 .* above --max-lora-rank 16"),
    "other-model": (lambda d: d["other-model"], "do not fit the base model .* another model"),
    "extra-layer": (
        lambda d: broken_copy(d, "layers", lambda c, t: _rename_layer(t)),
        "layer 5, but the base model has 2",
    ),
    "no-weights": (
        lambda d: broken_copy(d, "empty", lambda c, t: [t.pop(k) for k in list(t)]),
        "no LoRA weights",
    ),
    "shallower-model": (
        lambda d: broken_copy(d, "shallow", lambda c, t: [t.pop(k) for k in list(t) if ".layers.1." in k]),
        "has weights for 1 of the base model's 2 layers",
    ),
    "oversized": (
        lambda d: broken_copy(d, "big", lambda c, t: t.update({"padding": torch.zeros(4 << 20)})),
        "more than an adapter of rank 16 on every projection of this model can be",
    ),
    "lora-bias": (
        lambda d: broken_copy(d, "lbias", lambda c, t: c.update(lora_bias=True)),
        "LoRA biases on B",
    ),
    "alora": (
        lambda d: broken_copy(d, "alora", lambda c, t: c.update(alora_invocation_tokens=[1, 2])),
        "activated LoRA",
    ),
    "embedding": (
        lambda d: broken_copy(
            d,
            "embed",
            lambda c, t: t.update({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 320)}),
        ),
        "is not a LoRA A/B of a q/k/v/o/gate/up/down projection",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_adapter_is_refused_naming_the_problem_and_disturbs_nothing(llm, dirs, case):
    make_path, message = BAD[case]
    good = LoRARequest("good", 1, str(dirs["a"]))
    before = tokens(llm, good)
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.engine.add_lora(LoRARequest(f"bad-{case}", 50, str(make_path(dirs))))
    assert error.value.field == "lora_path" and error.value.status_code == 400
    with pytest.raises(InvalidRequestError, match=message):  # a request naming it: refused the same way
        tokens(llm, LoRARequest(f"bad-{case}", 50, str(make_path(dirs))))
    assert tokens(llm, good) == before
    assert [lora.lora_name for lora in llm.engine.list_loras()] == ["good"]
    assert all_free(llm)


def test_name_and_id_clashes_and_the_base_name_are_refused(llm, dirs):
    llm.engine.add_lora(LoRARequest("good", 1, str(dirs["a"])))
    llm.engine.add_lora(LoRARequest("good", 1, str(dirs["a"])))  # the same again: fine
    for lora, message in [
        (LoRARequest("good", 1, str(dirs["b"])), "already loaded from"),
        (LoRARequest("good", 2, str(dirs["a"])), "already loaded from"),
        (LoRARequest("another", 1, str(dirs["b"])), "id 1 is already adapter 'good'"),
        (LoRARequest(llm.engine.served_model_name, 9, str(dirs["b"])), "is the base model's name"),
        (
            LoRARequest("wrong-base", 9, str(dirs["b"]), base_model_name="someone/else"),
            "is for 'someone/else'",
        ),
        (LoRARequest("zero-id", 0, str(dirs["b"])), "lora_int_id: must be a positive integer"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            llm.engine.add_lora(lora)
    assert [lora.lora_name for lora in llm.engine.list_loras()] == ["good"]


def test_without_enable_lora_a_request_on_an_adapter_is_refused(dirs):
    plain = LLM(str(dirs["base"]), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled") as error:
        tokens(plain, LoRARequest("a", 1, str(dirs["a"])), prompt=PROMPT[:10])
    assert error.value.field == "lora_request"
    assert all_free(plain)


def test_adapters_never_share_prefix_cache_blocks(llm, dirs):
    a, b = LoRARequest("good", 1, str(dirs["a"])), LoRARequest("b", 2, str(dirs["b"]))
    prompt = [(17 * i) % 240 + 5 for i in range(33)]  # four full 8-token blocks to share
    kv = llm.engine.kv
    hits = []
    for lora in (a, None, b, a):
        before = kv.num_prefix_hits
        tokens(llm, lora, prompt)
        hits.append(kv.num_prefix_hits - before)
    assert hits == [0, 0, 0, 32]  # only the same adapter's second run finds its blocks


def test_kv_events_carry_the_adapter_and_its_hashes_differ():
    pool = BlockPool(16, record_events=True)
    kv = KVManager(pool, 4, True, PrefixHasher.create("sha256", "0"))
    prompt = list(range(9))
    for request_id, lora in (("base", None), ("tuned", (7, "sql"))):
        request = FakeRequest(request_id, prompt, num_computed_tokens=8, lora_key=lora)
        assert kv.allocate(request, 9)
        kv.cache_computed_blocks(request)
    stored = [e for e in pool.drain_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(None, None), (7, "sql")]
    assert set(stored[0].block_hashes).isdisjoint(stored[1].block_hashes)


def test_a_step_runs_at_most_max_loras_adapters_and_everyone_finishes(dirs):
    llm = LLM(str(dirs["base"]), dtype="float32", enable_lora=True, max_loras=1, max_model_len=128)
    engine = llm.engine
    loras = [LoRARequest("a", 1, str(dirs["a"])), LoRARequest("b", 2, str(dirs["b"])), None]
    for index in range(6):
        engine.add_request(
            f"r{index}", {"prompt_token_ids": PROMPT[: 10 + index]}, GREEDY, lora_request=loras[index % 3]
        )
    finished = set()
    while engine.has_unfinished_requests():
        _, running, _ = engine.lora_activity()
        assert len(running) <= 1
        finished |= {out.request_id for out in engine.step() if out.finished}
        assert len({r.lora for r in engine.scheduler.running if r.lora is not None}) <= 1
    assert finished == {f"r{i}" for i in range(6)}
    assert engine.lora_activity() == (1, [], [])


def test_beyond_max_cpu_loras_the_least_recent_adapter_is_read_again(dirs, caplog):
    llm = LLM(
        str(dirs["base"]), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_model_len=128
    )
    a, b = LoRARequest("a", 1, str(dirs["a"])), LoRARequest("b", 2, str(dirs["b"]))
    first = tokens(llm, a, PROMPT[:12])
    tokens(llm, b, PROMPT[:12])
    with caplog.at_level(logging.INFO, logger="kunlun_runtime.lora.registry"):
        assert tokens(llm, a, PROMPT[:12]) == first
    assert "LoRA adapter a read again" in caplog.text
    assert llm.engine.remove_lora("a") and not llm.engine.remove_lora("a")
    assert [lora.lora_name for lora in llm.engine.list_loras()] == ["b"]


def test_an_adapter_unloaded_while_requests_wait_serves_them_from_the_weights_they_hold(dirs, tmp_path):
    """Requests hold their adapter's weights from admission: unloading it, even deleting its
    files, while they wait for a slot never makes a step read (or fail to read) a checkpoint."""
    llm = LLM(str(dirs["base"]), dtype="float32", enable_lora=True, max_loras=1, max_model_len=128)
    copy = tmp_path / "b"
    shutil.copytree(dirs["b"], copy)
    a, b = LoRARequest("a", 1, str(dirs["a"])), LoRARequest("b", 2, str(copy))
    expected = tokens(
        LLM(str(dirs["base"]), dtype="float32", enable_lora=True, max_model_len=128), b, PROMPT[:12]
    )
    engine = llm.engine
    engine.add_request("on-a", {"prompt_token_ids": PROMPT[:10]}, GREEDY, lora_request=a)
    engine.add_request("on-b", {"prompt_token_ids": PROMPT[:12]}, GREEDY, lora_request=b)
    engine.step()  # a runs; b waits for the only slot
    assert [r.request_id for r in engine.scheduler.waiting] == ["on-b"]
    assert engine.remove_lora("b")
    shutil.rmtree(copy)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out for out in engine.step() if out.finished})
    assert outputs["on-b"].outputs[0].token_ids == expected
    assert all_free(llm)


def test_a_server_request_on_an_unloaded_adapter_is_404_not_registered_again(llm, dirs):
    gone = LoRARequest("gone", 40, str(dirs["b"]))
    with pytest.raises(InvalidRequestError, match="The model `gone` does not exist") as error:
        llm.engine.add_request(
            "x", {"prompt_token_ids": PROMPT[:5]}, GREEDY, lora_request=gone, register_lora=False
        )
    assert error.value.status_code == 404 and error.value.field == "model"
    assert "gone" not in [lora.lora_name for lora in llm.engine.list_loras()] and all_free(llm)


def test_an_adapter_loaded_again_under_its_name_never_finds_the_old_ones_blocks(llm, dirs):
    prompt = [(19 * i) % 230 + 7 for i in range(33)]
    llm.engine.add_lora(LoRARequest("swap", 60, str(dirs["a"])))
    tokens(llm, LoRARequest("swap", 60, str(dirs["a"])), prompt)
    assert llm.engine.remove_lora("swap")
    reloaded = LoRARequest("swap", 61, str(dirs["b"]))  # new weights, a new id
    before = llm.engine.kv.num_prefix_hits
    assert tokens(llm, reloaded, prompt) == tokens(
        LLM(str(dirs["base"]), dtype="float32", enable_lora=True, max_model_len=128, block_size=8),
        reloaded,
        prompt,
    )
    assert llm.engine.kv.num_prefix_hits == before  # the old weights' blocks are not its
    tokens(llm, reloaded, prompt)
    assert llm.engine.kv.num_prefix_hits - before == 32  # its own blocks, the second time
    llm.engine.remove_lora("swap")


def test_a_request_waiting_for_a_slot_is_not_starved_by_a_stream_on_the_running_adapter(dirs):
    llm = LLM(
        str(dirs["base"]),
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_model_len=128,
        priority_aging_steps=4,
    )
    engine = llm.engine
    a, b = LoRARequest("a", 1, str(dirs["a"])), LoRARequest("b", 2, str(dirs["b"]))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a-0", {"prompt_token_ids": PROMPT[:8]}, params, lora_request=a)
    engine.step()
    engine.add_request("on-b", {"prompt_token_ids": PROMPT[:9]}, params, lora_request=b)
    finished_b = None
    for step in range(60):  # a new request on a every step: without draining, b never gets the slot
        engine.add_request(f"a-{step + 1}", {"prompt_token_ids": PROMPT[:8]}, params, lora_request=a)
        if any(out.request_id == "on-b" and out.finished for out in engine.step()):
            finished_b = step
            break
    assert finished_b is not None and finished_b < 20
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(llm)


def test_a_request_refused_after_naming_an_adapter_holds_no_weights(llm, dirs):
    """A refusal after the adapter was resolved (here an invalid regex constraint) pins nothing:
    the weights a request holds are released with it, and a refused one never held any."""
    from kunlun_runtime import StructuredOutputsParams

    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request(
            "refused",
            {"prompt_token_ids": PROMPT[:5]},
            bad,
            lora_request=LoRARequest("good", 1, str(dirs["a"])),
        )
    assert llm.engine.adapters._pinned == {}
    assert all_free(llm)
