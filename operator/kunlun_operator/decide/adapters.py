"""LoRA adapters on the running pods: what to load and unload on each, and what the status says.

Owns: the per-pod plan (from the adapters the spec lists and those the pod's ``GET /v1/models``
serves), the ``AdaptersReady`` condition and ``status.adapters``. Pure: the shell
(``shell/pod_adapters.py``) makes the calls and reports what each answered. Invariant: an adapter
whose volume the pod does not mount is never loaded there (it waits for the rollout that adds the
volume), and an adapter served from another path is replaced in place, never left stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kunlun_operator import names
from kunlun_operator.builders.adapters import AdapterMount
from kunlun_operator.decide.status import Condition
from kunlun_operator.spec.values import InferenceSpec

CONDITION_TYPE = "AdaptersReady"
REASON_LOAD_FAILED = "AdapterLoadFailed"
#: A pass that left an adapter failed or waiting looks again after this long.
ADAPTER_RETRY_SECONDS = 30.0
AdapterStateName = Literal["Loaded", "Failed", "Pending"]


@dataclass(frozen=True, slots=True)
class AdapterPod:
    """A runtime pod the operator can call: its containers are ready and it has an address."""

    name: str
    uid: str
    address: str  # status.podIP
    port: int  # the containerPort named ``http`` (names.RUNTIME_PORT_NAME): where its runtime listens
    volumes: frozenset[str]  # the names of its volumes


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """One adapter a pod serves (``/v1/models``: an entry with a ``parent``; ``root`` is its path)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class AdapterAction:
    """One call to make on a pod: load (``inplace``: replace the adapter served under the name) or
    unload."""

    verb: Literal["load", "unload"]
    name: str
    path: str | None = None
    inplace: bool = False


@dataclass(frozen=True, slots=True)
class AdapterState:
    name: str
    state: AdapterStateName
    message: str = ""


@dataclass(frozen=True, slots=True)
class PodPlan:
    actions: tuple[AdapterAction, ...]  # in order: unloads first, then loads
    settled: tuple[AdapterState, ...]  # adapters needing no call: Loaded, or Pending


@dataclass(frozen=True, slots=True)
class PodAdapters:
    """One pod's adapters after the pass's calls."""

    pod: str
    states: tuple[AdapterState, ...]


@dataclass(frozen=True, slots=True)
class AdapterOutcome:
    pods: tuple[PodAdapters, ...] = ()
    recheck_after_seconds: float | None = None


def adapter_pod(pod: Mapping[str, Any]) -> AdapterPod | None:
    """The pod as ``AdapterPod`` when its containers are ready (the runtime answers; the readiness
    gate on card health does not matter here), it has an IP and a container port named ``http``
    (a multi-node group's workers have none: only the leader serves the API); else None."""
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "ContainersReady" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    port = runtime_port(pod)
    if not ready or not status.get("podIP") or port is None:
        return None
    meta = pod["metadata"]
    volumes = frozenset(v["name"] for v in (pod.get("spec") or {}).get("volumes") or [] if v.get("name"))
    return AdapterPod(meta["name"], meta.get("uid") or meta["name"], status["podIP"], port, volumes)


def runtime_port(pod: Mapping[str, Any]) -> int | None:
    """The pod's own ``http`` container port (the pod template's, so a pod keeps the port it was
    built with); None when no container has one."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if port.get("name") == names.RUNTIME_PORT_NAME and isinstance(number, int):
                return number
    return None


def parse_served(models: Any) -> tuple[ServedAdapter, ...]:
    """The adapters of a ``GET /v1/models`` answer (entries with a ``parent``).

    Raises:
        ValueError: the answer is not an OpenAI model list (e.g. a proxy's page in front of the pod).
    """
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        raise ValueError(f"not an OpenAI model list: {str(models)[:200]!r}")
    return tuple(
        ServedAdapter(str(m["id"]), str(m.get("root") or ""))
        for m in data
        if isinstance(m, Mapping) and m.get("parent") and m.get("id")
    )


def plan_pod(
    desired: Sequence[AdapterMount], served: Iterable[ServedAdapter], volumes: frozenset[str]
) -> PodPlan:
    """What to call on one pod so that it serves exactly ``desired``."""
    by_name = {s.name: s for s in served}
    wanted = {m.name for m in desired}
    actions = [AdapterAction("unload", name) for name in by_name if name not in wanted]
    settled: list[AdapterState] = []
    for mount in desired:
        current = by_name.get(mount.name)
        if mount.volume not in volumes:
            message = f"its volume {mount.volume} is not mounted in this pod yet (the rollout adds it)"
            settled.append(AdapterState(mount.name, "Pending", message))
        elif current is not None and current.path == mount.path:
            settled.append(AdapterState(mount.name, "Loaded"))
        else:
            actions.append(AdapterAction("load", mount.name, mount.path, inplace=current is not None))
    return PodPlan(tuple(actions), tuple(settled))


def adapters_status(outcome: AdapterOutcome) -> list[dict[str, Any]]:
    """``status.adapters``: per pod, each adapter's state (and message when there is one)."""
    return [
        {
            "pod": pod.pod,
            "adapters": [
                {"name": s.name, "state": s.state, **({"message": s.message} if s.message else {})}
                for s in pod.states
            ],
        }
        for pod in outcome.pods
    ]


def adapters_condition(spec: InferenceSpec, outcome: AdapterOutcome | None, ready: int) -> Condition | None:
    """``AdaptersReady`` (None with LoRA off). Without run-time updates every pod reads the
    adapters at start and does not start without them, so a ready replica serves them all."""
    lora = spec.runtime.lora
    if lora is None:
        return None
    count = len(spec.model.adapters)
    if not lora.runtime_updates or outcome is None:
        if ready > 0:
            return Condition(
                CONDITION_TYPE, "True", "ReadAtStart", f"{count} adapter(s) read at start by every ready pod"
            )
        return Condition(CONDITION_TYPE, "Unknown", "NoReadyPods", "no ready pod serves the adapters yet")
    if not outcome.pods:
        return Condition(CONDITION_TYPE, "Unknown", "NoReadyPods", "no ready pod to load the adapters on yet")
    failed = [(p.pod, s) for p in outcome.pods for s in p.states if s.state == "Failed"]
    if failed:
        text = "; ".join(f"{pod}: {s.name}: {s.message}" for pod, s in failed)
        return Condition(CONDITION_TYPE, "False", REASON_LOAD_FAILED, text)
    pending = sorted({s.name for p in outcome.pods for s in p.states if s.state == "Pending"})
    if pending:
        text = f"{', '.join(pending)} wait(s) for the rollout that mounts their volume"
        return Condition(CONDITION_TYPE, "Unknown", "WaitingForRollout", text)
    return Condition(
        CONDITION_TYPE,
        "True",
        "AdaptersLoaded",
        f"{count} adapter(s) loaded on {len(outcome.pods)} ready pod(s)",
    )
