"""Which pod and container hold each card, from kubelet's PodResources API (`v1`, `List`).

Invariant: attribution is best effort — an unreachable or failing socket yields no attribution and
a log line, never an exception into the exporter loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from kunlun_device.api import podresources_v1_pb2 as pb
from kunlun_device.api import podresources_v1_pb2_grpc as pb_grpc
from kunlun_device.labels import RESOURCE_NAME

logger = logging.getLogger(__name__)
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


@dataclass(frozen=True, slots=True)
class Holder:
    """The workload a card is assigned to."""

    namespace: str
    pod: str
    container: str


def parse_list_response(
    response: pb.ListPodResourcesResponse, resource_name: str = RESOURCE_NAME
) -> dict[str, Holder]:
    """Map device id -> holder for the devices of `resource_name` in a `List` answer."""
    holders: dict[str, Holder] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name != resource_name:
                    continue
                for device_id in devices.device_ids:
                    holders[device_id] = Holder(pod.namespace, pod.name, container.name)
    return holders


class PodResourcesClient:
    """Calls `List` on kubelet's PodResources socket."""

    def __init__(self, socket_path: str, timeout_seconds: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_seconds = timeout_seconds
        self.errors_total = 0

    def holders(self) -> dict[str, Holder]:
        """Device id -> holder; empty (and logged) when kubelet cannot be asked."""
        try:
            with grpc.insecure_channel(f"unix://{self.socket_path}") as channel:
                response = pb_grpc.PodResourcesListerStub(channel).List(
                    pb.ListPodResourcesRequest(), timeout=self.timeout_seconds
                )
        except grpc.RpcError as exc:
            self.errors_total += 1
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            logger.warning("PodResources List on %s failed: %s", self.socket_path, details)
            return {}
        return parse_list_response(response)
