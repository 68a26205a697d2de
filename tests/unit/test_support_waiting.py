"""The tests' shared poller: it returns the first truthy value and fails at the deadline saying why.

A fake clock stands in for time (virtual time), so none of these tests sleeps, except the one that
checks the poller against the real clock with a deadline of a hundredth of a second.
"""

from __future__ import annotations

import pytest

from tests.support import waiting
from tests.support.waiting import wait_for


class FakeClock:
    """``monotonic`` and ``sleep`` for ``tests.support.waiting``: sleeping advances the time at once."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Probe:
    """A predicate answering ``answers`` in turn (raising those that are exceptions), then the last
    one forever; ``calls`` counts how often it was asked."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> object:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(waiting, "monotonic", fake.monotonic)
    monkeypatch.setattr(waiting, "sleep", fake.sleep)
    return fake


def test_returns_the_first_truthy_value(clock: FakeClock) -> None:
    probe = Probe(None, 0, {}, {"phase": "Ready"}, {"phase": "Later"})
    assert wait_for(probe, timeout_seconds=5, interval_seconds=0.25, message="the status") == {
        "phase": "Ready"
    }
    assert probe.calls == 4
    assert clock.sleeps == [0.25, 0.25, 0.25]


def test_a_value_already_there_is_returned_without_sleeping_even_with_no_time_left(clock: FakeClock) -> None:
    probe = Probe("ready")
    assert wait_for(probe, timeout_seconds=0, message="readiness") == "ready"
    assert (probe.calls, clock.sleeps) == (1, [])


def test_times_out_naming_what_it_waited_for_and_the_last_value_seen(clock: FakeClock) -> None:
    probe = Probe(None, [])
    with pytest.raises(AssertionError) as caught:
        wait_for(probe, timeout_seconds=1, interval_seconds=0.25, message="the Service back")
    assert str(caught.value) == "timed out after 1s waiting for the Service back; last seen: []"
    assert (probe.calls, clock.sleeps, clock.now) == (5, [0.25] * 4, 1.0)


def test_the_last_sleep_is_cut_short_at_the_deadline_where_the_predicate_is_asked_again(
    clock: FakeClock,
) -> None:
    probe = Probe(False)
    with pytest.raises(AssertionError):
        wait_for(probe, timeout_seconds=1.5, interval_seconds=1, message="never")
    assert (probe.calls, clock.sleeps) == (3, [1, 0.5])


def test_an_ignored_exception_counts_as_not_yet(clock: FakeClock) -> None:
    probe = Probe(LookupError("not found"), "found")
    assert wait_for(probe, timeout_seconds=5, message="the object", ignoring=(LookupError,)) == "found"
    assert probe.calls == 2


def test_an_ignored_exception_is_the_last_value_seen_at_the_deadline(clock: FakeClock) -> None:
    probe = Probe(LookupError("not found"))
    with pytest.raises(AssertionError) as caught:
        wait_for(probe, timeout_seconds=1, message="the object", ignoring=(LookupError,))
    assert (
        str(caught.value) == "timed out after 1s waiting for the object; last seen: LookupError('not found')"
    )


def test_any_other_exception_propagates_at_once(clock: FakeClock) -> None:
    probe = Probe(ValueError("broken probe"), "never reached")
    with pytest.raises(ValueError, match=r"^broken probe$"):
        wait_for(probe, timeout_seconds=5, message="the object", ignoring=(LookupError,))
    assert (probe.calls, clock.sleeps) == (1, [])


def test_on_the_real_clock_it_gives_up_at_the_deadline() -> None:
    probe = Probe(False)
    with pytest.raises(
        AssertionError, match=r"^timed out after 0\.01s waiting for nothing; last seen: False$"
    ):
        wait_for(probe, timeout_seconds=0.01, interval_seconds=0.002, message="nothing")
    assert probe.calls >= 2  # asked at the start and at the deadline, at least
