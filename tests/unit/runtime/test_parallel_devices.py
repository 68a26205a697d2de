"""Each tensor-parallel rank binds its own device before any collective; the preflight checks it.

The platform here is a real subclass of the CPU platform that binds devices the way an accelerator
platform does (it records ``set_device`` and reports the bound index), run through the real
``LeaderGroup`` and a real gloo group in this process (world size 1: the worker processes
of larger worlds are exercised by tests/golden/test_tensor_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.parallel.group import check_device_binding, free_port
from kunlun_runtime.parallel.layout import ParallelLayout
from kunlun_runtime.parallel.workers import LeaderGroup, RankSpec
from kunlun_runtime.platforms import CpuPlatform
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


class BindingPlatform(CpuPlatform):
    """The CPU platform with per-rank devices: ``set_device(r)`` binds device ``r + offset``."""

    def __init__(self, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset  # != 0: a platform that binds the wrong device
        self.set_device_calls: list[int] = []
        self.bound: int | None = None

    def set_device(self, local_rank: int) -> None:
        self.set_device_calls.append(local_rank)
        self.bound = local_rank + self.offset

    def current_device_index(self) -> int | None:
        return self.bound


def make_rank_spec(platform: CpuPlatform, model_dir: str) -> RankSpec:
    return RankSpec(
        model_dir=model_dir,
        dtype=torch.float32,
        weight_dtype=torch.float32,
        max_positions=16,
        num_blocks=1,
        block_size=16,
        cache_line_bytes=64,
        cache_num_sets=4096,
        kv_block_skew=False,
        linear_backend="plain",
        quantization=None,
        fused_attention=False,
        native_kernels=False,
        layout=ParallelLayout(),
        stages=(range(2),),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=free_port(),
        platform=platform,
    )


def test_rank_zero_binds_its_device_before_joining_and_the_preflight_passes(tiny_model_dir) -> None:
    platform = BindingPlatform()
    group = LeaderGroup(make_rank_spec(platform, str(tiny_model_dir)))
    try:
        group.start()  # binds, joins, loads, then the preflight: every rank's device: [0]
        assert platform.set_device_calls == [0]
    finally:
        group.close()


def test_a_rank_on_another_device_fails_the_preflight_naming_it(tiny_model_dir) -> None:
    platform = BindingPlatform(offset=1)
    group = LeaderGroup(make_rank_spec(platform, str(tiny_model_dir)))
    with pytest.raises(EngineDeadError) as failure:
        group.start()
    assert str(failure.value) == (
        "collective preflight: rank 0 of 1 (node 0, backend gloo) is bound to device 1, expected device 0 "
        "(its local rank); devices by rank: [1]"
    )


def test_the_cpu_binds_nothing_and_reports_no_device() -> None:
    platform = CpuPlatform()
    platform.set_device(3)
    assert platform.current_device_index() is None
    check_device_binding([None, None], "gloo")  # CPU ranks: nothing to compare


@pytest.mark.parametrize(
    ("reported", "message"),
    [
        ([0, 1, 2, 3], None),
        (
            [0, 0],  # what TP did before ranks bound their devices: everyone on device 0
            "rank 1 of 2 (node 0, backend nccl) is bound to device 0, expected device 1 (its local rank); "
            "devices by rank: [0, 0]",
        ),
        (
            [0, 2, 1],
            "rank 1 of 3 (node 0, backend nccl) is bound to device 2, expected device 1 (its local rank); "
            "devices by rank: [0, 2, 1]",
        ),
        (
            [0, None],
            "rank 1 of 2 (node 0, backend nccl) is bound to no device, expected device 1 (its local rank); "
            "devices by rank: [0, None]",
        ),
    ],
)
def test_rank_r_must_report_device_r(reported: list[int | None], message: str | None) -> None:
    if message is None:
        check_device_binding(reported, "nccl")
        return
    with pytest.raises(EngineDeadError) as failure:
        check_device_binding(reported, "nccl")
    assert str(failure.value) == f"collective preflight: {message}"
