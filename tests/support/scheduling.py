"""Driving the scheduler without a model, as the engine would (shared by the scheduler tests)."""

from kunlun_runtime.engine.request import RequestStatus


def run_step(scheduler):
    """Apply one schedule as the engine would (untimed): compute tokens, sample a fake token, finish."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, elapsed_seconds=None)
    for item in out.scheduled:
        request = item.request
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(1)
            if request.num_tokens >= request.max_total_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    return out


def summary(out):
    """(request id, tokens this step) of every scheduled request, in schedule order."""
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
