"""Each tenant's share of the waiting queue, so that one client cannot fill it for everyone.

A tenant holds the requests it has queued but the engine has not yet taken in (pending) plus those
in the scheduler's waiting queue after the last step. ``admit`` refuses a group that would take a
tenant past ``max_waiting_share`` of ``max_queue_len`` places with ``QueueFullError`` (429);
``check_fits`` refuses a group that could never be admitted, larger than the queue or than a
tenant's share of it, with a 400 naming ``n``.
Running requests do not count: a tenant alone on the server still gets every batch slot.

Not thread-safe by itself: ``AsyncEngine`` calls ``admit``/``taken_in``/``set_waiting`` under its
lock, and ``track``/``forget``/``count_waiting`` from the engine thread only. With no share
(a lone tenant) every method does nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.errors import QueueFullError

DEFAULT_MAX_WAITING_SHARE = 0.5


class WaitingShares:
    def __init__(self, max_waiting_share: float | None, max_queue_len: int | None) -> None:
        self.max_waiting_share = max_waiting_share
        self.max_queue_len = max_queue_len
        self.limit: int | None = None  # most places one tenant may hold; None = no limit
        if max_waiting_share is not None and max_queue_len is not None:
            self.limit = max(1, math.floor(max_waiting_share * max_queue_len))
        self._pending: Counter[str] = Counter()  # under the caller's lock
        self._waiting: Counter[str] = Counter()  # under the caller's lock
        self._tenant_of: dict[str, str] = {}  # request id → tenant, engine thread only

    def check_fits(self, tenant: str | None, num_requests: int) -> None:
        """Raises InvalidRequestError naming ``n`` when a group of ``num_requests`` could never
        be admitted: more than the queue's places, or than one tenant may ever hold."""
        if self.max_queue_len is not None and num_requests > self.max_queue_len:
            raise InvalidRequestError(
                f"n: this request needs {num_requests} places in the queue, more than it ever has "
                f"({self.max_queue_len}, --max-queue-len); lower n or the number of prompts",
                field="n",
            )
        share = self.limit if tenant is not None else None
        if share is not None and num_requests > share:
            raise InvalidRequestError(
                f"n: this request needs {num_requests} places in the queue, more than one API key may "
                f"ever hold ({share} of {self.max_queue_len}, --max-waiting-share "
                f"{self.max_waiting_share}); lower n or the number of prompts",
                field="n",
            )

    def admit(self, tenant: str | None, num_requests: int) -> None:
        """Count ``num_requests`` more pending requests of ``tenant``.

        Raises QueueFullError, counting nothing, when that would exceed the tenant's share.
        """
        if self.limit is None or tenant is None:
            return
        held = self._pending[tenant] + self._waiting[tenant]
        if held + num_requests > self.limit:
            raise QueueFullError(
                f"too many requests waiting for this API key ({held} waiting, {num_requests} more asked): "
                f"one tenant may hold at most {self.limit} of the {self.max_queue_len} waiting places "
                f"(--max-waiting-share {self.max_waiting_share}); retry later"
            )
        self._pending[tenant] += num_requests

    def taken_in(self, tenant: str | None, num_requests: int) -> None:
        """The engine thread has taken ``num_requests`` pending requests of ``tenant`` in: they wait
        in the scheduler now, and count as waiting until the next step recounts (``set_waiting``),
        so that in between they count as neither pending nor waiting."""
        if self.limit is not None and tenant is not None:
            self.released(tenant, num_requests)
            self._waiting[tenant] += num_requests

    def released(self, tenant: str | None, num_requests: int) -> None:
        """``num_requests`` pending requests of ``tenant`` will never be queued (preparing failed)."""
        if self.limit is not None and tenant is not None:
            self._pending[tenant] -= num_requests
            if self._pending[tenant] <= 0:
                del self._pending[tenant]

    def track(self, request_id: str, tenant: str | None) -> None:
        if self.limit is not None and tenant is not None:
            self._tenant_of[request_id] = tenant

    def forget(self, request_id: str) -> None:
        self._tenant_of.pop(request_id, None)

    def count_waiting(self, waiting_request_ids: Iterable[str]) -> Counter[str]:
        """Waiting requests per tenant, from the scheduler's waiting queue (engine thread)."""
        if self.limit is None:
            return Counter()
        tenants = (self._tenant_of.get(request_id) for request_id in waiting_request_ids)
        return Counter(tenant for tenant in tenants if tenant is not None)

    def set_waiting(self, waiting: Counter[str]) -> None:
        self._waiting = waiting
