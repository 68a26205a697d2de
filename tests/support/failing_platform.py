"""A CPU platform whose device binding fails on one local rank, as a missing or broken card would
(importable by spawned rank processes, which unpickle it)."""

from __future__ import annotations

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.platforms import CpuPlatform


class FailingBindPlatform(CpuPlatform):
    def __init__(self, failing_local_rank: int) -> None:
        super().__init__()
        self.failing_local_rank = failing_local_rank

    def set_device(self, local_rank: int) -> None:
        if local_rank == self.failing_local_rank:
            raise EngineDeadError(f"card {local_rank} is not there")
