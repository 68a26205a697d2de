"""The shell around ``decide/adapters``: load and unload LoRA adapters on the ready runtime pods.

Owns: the HTTP calls to each pod's runtime (``GET /v1/models``, vLLM's ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, with the service's API key as a bearer
token), and turning their answers into each adapter's state. Synchronous (called from the
controller's pass). Invariant: a pod that cannot be reached or refuses a load is reported (Failed,
with the runtime's message), never skipped silently; nothing here writes to the Kubernetes API.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kunlun_operator.builders.adapters import AdapterMount
from kunlun_operator.decide.adapters import (
    ADAPTER_RETRY_SECONDS,
    AdapterAction,
    AdapterOutcome,
    AdapterPod,
    AdapterState,
    PodAdapters,
    parse_served,
    plan_pod,
)
from kunlun_operator.errors import ApiError
from kunlun_operator.shell.kube import SECRET, KubeClient
from kunlun_operator.spec.values import SecretKeyRef

logger = logging.getLogger(__name__)

#: A load reads and checks the checkpoint on the runtime's worker thread: allow for a large one.
CALL_TIMEOUT_SECONDS = 120.0


class PodCallError(Exception):
    """A call to a pod's runtime failed: no answer, or an HTTP error (its message is the runtime's)."""


def pod_url(pod: AdapterPod) -> str:
    """The runtime's base URL on the pod: its IP and its own ``http`` container port."""
    host = f"[{pod.address}]" if ":" in pod.address else pod.address
    return f"http://{host}:{pod.port}"


def call_pod(url: str, api_key: str | None, body: Mapping[str, Any] | None = None) -> Any:
    """GET ``url`` (POST ``body`` as JSON when given); the JSON answer, or its text.

    Raises:
        PodCallError: no answer, or HTTP ≥ 400 (the runtime's ``error.message`` when it sent one).
    """
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        url, data=data, headers=headers, method="GET" if data is None else "POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_SECONDS) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as error:
        raise PodCallError(f"{error.code} {_error_message(error.read().decode(errors='replace'))}") from None
    except (OSError, ValueError) as error:  # URLError, refused, timed out
        raise PodCallError(str(getattr(error, "reason", error))) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:500]


def read_api_key(client: KubeClient, namespace: str, secret: SecretKeyRef | None) -> str | None:
    """The runtime's API key from ``spec.apiKeySecretRef`` (None: the pods need none).

    Raises:
        ApiError: the Secret or its key cannot be read (a missing one too: the pods need the key).
    """
    if secret is None:
        return None
    body = client.get(SECRET, namespace, secret.name)
    value = ((body or {}).get("data") or {}).get(secret.key)
    call = f"GET Secret {namespace}/{secret.name}"
    if value is None:
        what = "does not exist" if body is None else f"has no key {secret.key}"
        raise ApiError(404, "NotFound", f"the API key Secret {secret.name} {what}", call=call)
    try:
        return base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(422, "Invalid", f"key {secret.key} is not base64 text", call=call) from None


def unreachable(pods: Iterable[AdapterPod], desired: Sequence[AdapterMount], message: str) -> AdapterOutcome:
    """Every adapter of every pod Failed with ``message`` (no call could be made)."""
    states = tuple(AdapterState(m.name, "Failed", message) for m in desired)
    return AdapterOutcome(tuple(PodAdapters(p.name, states) for p in pods), ADAPTER_RETRY_SECONDS)


class AdapterSyncer:
    """Makes every ready pod of a service serve exactly its adapters (``decide.adapters.plan_pod``)."""

    def sync(
        self, where: str, desired: Sequence[AdapterMount], pods: Iterable[AdapterPod], api_key: str | None
    ) -> AdapterOutcome:
        """Load and unload on each pod; ``where`` (``namespace/name``) is for the logs."""
        results = tuple(self._sync_pod(where, desired, pod, api_key) for pod in pods)
        unsettled = any(s.state != "Loaded" for p in results for s in p.states)
        return AdapterOutcome(results, ADAPTER_RETRY_SECONDS if unsettled else None)

    def _sync_pod(
        self, where: str, desired: Sequence[AdapterMount], pod: AdapterPod, api_key: str | None
    ) -> PodAdapters:
        base = pod_url(pod)
        try:
            served = parse_served(call_pod(f"{base}/v1/models", api_key))
        except (PodCallError, ValueError) as error:
            logger.warning("%s: cannot list the adapters of pod %s: %s", where, pod.name, error)
            failed = tuple(AdapterState(m.name, "Failed", f"GET /v1/models: {error}") for m in desired)
            return PodAdapters(pod.name, failed)
        plan = plan_pod(desired, served, pod.volumes)
        states = list(plan.settled)
        for action in plan.actions:
            state = self._act(base, action, api_key)
            if state is not None:
                states.append(state)
            if state is None or state.state == "Loaded":
                logger.info("%s: %sed adapter %s on pod %s", where, action.verb, action.name, pod.name)
            else:
                logger.warning(
                    "%s: pod %s: %s %s: %s", where, pod.name, action.verb, action.name, state.message
                )
        order = {m.name: i for i, m in enumerate(desired)}
        states.sort(key=lambda s: order.get(s.name, len(order)))
        return PodAdapters(pod.name, tuple(states))

    @staticmethod
    def _act(base: str, action: AdapterAction, api_key: str | None) -> AdapterState | None:
        """Make one call; the adapter's state after it (None: unloaded, as asked)."""
        if action.verb == "unload":
            try:
                call_pod(f"{base}/v1/unload_lora_adapter", api_key, {"lora_name": action.name})
            except PodCallError as error:
                return AdapterState(action.name, "Failed", f"unload: {error}")
            return None
        body: dict[str, Any] = {"lora_name": action.name, "lora_path": action.path}
        if action.inplace:
            body["load_inplace"] = True
        try:
            call_pod(f"{base}/v1/load_lora_adapter", api_key, body)
        except PodCallError as error:
            return AdapterState(action.name, "Failed", str(error))
        return AdapterState(action.name, "Loaded")
