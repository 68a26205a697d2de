"""``--kv-cache-dtype``: its resolution against the activations and the platform, the flag and the
config field, and the plan that carries it to every rank separately from the activation dtype."""

from dataclasses import replace

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import build_parser
from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.kv_dtype import resolve_kv_cache_dtype
from kunlun_runtime.models.model_config import load_model_config
from kunlun_runtime.options.flags import engine_config_from_args
from kunlun_runtime.parallel.rank_plan import plan_ranks
from kunlun_runtime.platforms import CpuPlatform
from kunlun_runtime.platforms.cuda import CudaPlatform
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

F32, BF16 = torch.float32, torch.bfloat16


class GpuWithBf16(CudaPlatform):
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (F32, BF16, torch.float16)


class GpuWithoutBf16(CudaPlatform):
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (F32, torch.float16)


@pytest.mark.parametrize(
    ("name", "dtype", "dtype_is_auto", "platform", "expected"),
    [
        # FP32 activations chosen by a CPU without native BF16 (AVX2 tier, plain floor): BF16 K/V.
        ("auto", F32, True, CpuPlatform(), BF16),
        # The AVX-512 tier computes in BF16: its cache stays BF16, as before.
        ("auto", BF16, True, CpuPlatform(), BF16),
        # --dtype float32 asked for by name (golden runs): FP32 throughout.
        ("auto", F32, False, CpuPlatform(), F32),
        # Accelerators keep vLLM's meaning of auto: the activations' dtype.
        ("auto", torch.float16, True, GpuWithBf16(), torch.float16),
        ("auto", F32, True, GpuWithBf16(), F32),
        # Explicit choices win over auto's rule.
        ("float32", F32, True, CpuPlatform(), F32),
        ("float32", BF16, True, CpuPlatform(), F32),
        ("bfloat16", F32, False, CpuPlatform(), BF16),
        ("bfloat16", torch.float16, True, GpuWithBf16(), BF16),
    ],
)
def test_kv_cache_dtype_resolution(name, dtype, dtype_is_auto, platform, expected):
    assert resolve_kv_cache_dtype(name, dtype, platform, dtype_is_auto=dtype_is_auto) == expected


@pytest.mark.parametrize(
    ("name", "platform", "message"),
    [
        (
            "float16",
            CpuPlatform(),
            "kv_cache_dtype: must be one of \\['auto', 'bfloat16', 'float32'\\], got 'float16'",
        ),
        ("fp8", CpuPlatform(), "got 'fp8'"),
        ("bfloat16", GpuWithoutBf16(), "kv_cache_dtype: bfloat16 is not supported on cuda"),
    ],
)
def test_kv_cache_dtypes_that_cannot_be_stored_are_refused_naming_the_field(name, platform, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve_kv_cache_dtype(name, F32, platform)
    assert error.value.field == "kv_cache_dtype"


def test_engine_config_refuses_other_kv_cache_dtypes_naming_the_field():
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of") as error:
        EngineConfig(kv_cache_dtype="fp8_e4m3").validate()  # type: ignore[arg-type]
    assert error.value.field == "kv_cache_dtype"
    assert EngineConfig().kv_cache_dtype == "auto"


def _parse(*argv):
    return engine_config_from_args(build_parser().parse_args(["generate", "--prompt", "x", *argv]))


def test_the_flag_and_config_files_set_the_kv_cache_dtype(tmp_path):
    assert _parse().kv_cache_dtype == "auto"
    assert _parse("--kv-cache-dtype", "float32").kv_cache_dtype == "float32"
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "fp8")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("kv-cache-dtype: bfloat16\n")
    bad.write_text("kv_cache_dtype: int8\n")
    assert _parse("--config", str(good)).kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="kv_cache_dtype") as error:
        _parse("--config", str(bad))
    assert error.value.field == "kv_cache_dtype"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("kv-dtype") / "tiny", TINY_SPECS["llama-gqa"])


def _plan(model_dir, **options):
    # Unskewed blocks: both dtypes' blocks are whole cache lines, so the bytes compare exactly.
    config = EngineConfig(model=str(model_dir), kv_cache_memory_bytes=1 << 20, kv_block_skew=False, **options)
    config.validate()
    return plan_ranks(config, CpuPlatform(), load_model_config(model_dir), model_dir, 64)


def test_the_plan_carries_the_kv_dtype_apart_from_the_activations_and_ranks_must_agree_on_it(
    model_dir, monkeypatch
):
    monkeypatch.setattr(CpuPlatform, "default_dtype", lambda self: F32)  # a CPU without native BF16
    bf16_kv = _plan(model_dir)
    fp32_kv = _plan(model_dir, kv_cache_dtype="float32")
    assert (bf16_kv.dtype, bf16_kv.cache_dtype) == (F32, BF16)
    assert (fp32_kv.dtype, fp32_kv.cache_dtype) == (F32, F32)
    # The same budget holds twice the blocks.
    assert bf16_kv.num_blocks == 2 * fp32_kv.num_blocks
    # Nodes that resolved another KV dtype would build another cache: the preflight refuses them.
    assert (
        bf16_kv.agreement() != replace(bf16_kv, kv_cache_dtype=F32, num_blocks=bf16_kv.num_blocks).agreement()
    )
    assert replace(bf16_kv, kv_cache_dtype=None).cache_dtype == F32  # unset: the activations'


def test_the_engine_allocates_and_reports_the_resolved_kv_dtype(model_dir, monkeypatch):
    monkeypatch.setattr(CpuPlatform, "default_dtype", lambda self: F32)
    options = {
        "kv_block_skew": False,  # blocks of whole cache lines in both dtypes: capacities compare exactly
        "kv_cache_memory": "1MiB",
        "max_model_len": 64,
        "native_kernels": False,
        "linear_backend": "plain",
    }
    bf16 = LLM(str(model_dir), dtype="auto", **options).engine
    fp32 = LLM(str(model_dir), dtype="auto", kv_cache_dtype="float32", **options).engine
    assert (bf16.dtype, bf16.kv_cache_dtype, bf16.kv_cache.k_blocks[0].dtype) == (F32, BF16, BF16)
    assert (fp32.dtype, fp32.kv_cache_dtype, fp32.kv_cache.v_blocks[0].dtype) == (F32, F32, F32)
    assert bf16.num_kv_tokens == 2 * fp32.num_kv_tokens
    reference = LLM(str(model_dir), dtype="float32", **options).engine  # named FP32: FP32 K/V
    assert reference.kv_cache_dtype == F32


def test_a_cache_no_kernel_reads_runs_the_plain_path_and_says_so(model_dir, caplog):
    from kunlun_runtime.layers import cpu_kernels

    if not cpu_kernels.load(BF16):
        pytest.skip(str(cpu_kernels.unavailable_reason(BF16)))
    options = {"kv_cache_memory": "1MiB", "max_model_len": 64}
    with caplog.at_level("WARNING", logger="kunlun_runtime.parallel.workers"):
        llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype="float32", **options)
    assert llm.engine.model.native_kernels and llm.engine.kv_cache.k_blocks[0].dtype == F32
    assert "no kernel reads a torch.float32 KV cache under torch.bfloat16 activations" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
    outputs = llm.generate(prompts, params)  # prefill, then decode steps over the FP32 cache
    assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]


def test_a_rank_whose_process_cannot_load_the_kernels_says_so(model_dir, monkeypatch, caplog):
    from kunlun_runtime.layers import cpu_kernels
    from kunlun_runtime.parallel.workers import build_rank

    spec = _plan(model_dir, dtype="bfloat16", native_kernels=True, linear_backend="plain")
    # The node planned with its own process's kernels; this rank's cannot load them (a native
    # linear backend would refuse to build the rank, naming why; the layers would fall back).
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda dtype=BF16: "loading X.so failed: bad ELF")
    with caplog.at_level("WARNING", logger="kunlun_runtime.parallel.workers"):
        model, _, _ = build_rank(spec, 0)
    assert not model.native_kernels
    assert (
        "rank 0: our CPU kernels did not load in this process; its layers run on plain PyTorch "
        "(slower decode): loading X.so failed: bad ELF"
    ) in caplog.text

    # required (the images' KUNLUN_REQUIRE_NATIVE_KERNELS=1): the rank refuses to start instead
    required = replace(spec, require_native_kernels=True)
    with pytest.raises(ConfigError, match=r"rank 0's process could not load our CPU kernels: loading X\.so"):
        build_rank(required, 0)
