"""What the scheduler decides for one step: the plain data it hands to the model runner.

Only data lives here (no policy, no tensors), so the model runner and the engine depend on the
scheduler's decisions without depending on how they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.step_cost import StepFeatures


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    num_draft_tokens: int = 0  # of which drafts (speculative decoding), after the request's last token


@dataclass(slots=True)
class SchedulerOutput:
    """The whole step: what runs, who was preempted to make room, and the step's composition."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running ones first, then new
    preempted: list[Request] = field(default_factory=list)  # preempted this step
    num_batched_tokens: int = 0
    features: StepFeatures = field(default_factory=StepFeatures)  # composition, for the step-time model

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
