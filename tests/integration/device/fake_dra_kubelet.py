"""A test playing kubelet's side of DRA: the plugin watcher, the DRA client and the health watcher.

`FakeDraKubelet.register()` does what kubelet's plugin watcher does: finds the plugin's socket in the
registry directory, asks `GetInfo`, checks the type and driver and picks the newest DRAPlugin service
the plugin lists (v1, else v1beta1), then reports the outcome with `NotifyRegistrationStatus`.
`prepare`/`unprepare` then call the chosen (or a given) DRAPlugin version on the plugin's endpoint,
and `watch_health()` opens `NodeWatchResources`; `allocated_resources_status` is what kubelet writes
into a container's `allocatedResourcesStatus` from a prepare answer and the health it was streamed.
`DraNode` bundles one plugin (`DraServer` over a fixture host copy), the fake Kubernetes API holding
its Node and claims, and this fake kubelet.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import kubernetes

from kunlun_device.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from kunlun_device.api import drahealth_v1alpha1_pb2 as hpb
from kunlun_device.api import drahealth_v1alpha1_pb2_grpc as hpb_grpc
from kunlun_device.api import pluginregistration_v1_pb2 as reg
from kunlun_device.api import pluginregistration_v1_pb2_grpc as reg_grpc
from kunlun_device.dra.kube import KubeClaims
from kunlun_device.dra.server import DraServer
from kunlun_device.xpu.health import HealthPolicy
from tests.integration.device.fake_kubelet import short_tempdir
from tests.support.kubeapi import RunningKubeAPI, running_fake_api
from tests.support.waiting import wait_for
from tests.unit.device.hosts import copy_host, make_source

DRIVER = "xpu.kunlun.dev"
NODE = "node-a"
#: kubelet's names of the DRAPlugin services, newest first, with their generated modules.
SERVICES: dict[str, tuple[ModuleType, Any]] = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub),
}


class FakeDraKubelet:
    """kubelet's plugin watcher and DRA client for one driver."""

    def __init__(self, registry_dir: Path) -> None:
        self.registry_dir = registry_dir
        self.info: reg.PluginInfo | None = None
        self.service = ""

    def register(self, timeout_seconds: float = 20.0) -> reg.PluginInfo:
        socket = wait_for(
            lambda: next((p for p in sorted(self.registry_dir.glob("*.sock")) if p.is_socket()), None),
            timeout_seconds=timeout_seconds,
            message="a plugin socket in the registry directory",
        )
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg.InfoRequest(), timeout=10)
            chosen = next((s for s in SERVICES if s in info.supported_versions), "")
            error = "" if info.type == "DRAPlugin" and info.name == DRIVER and chosen else "unusable plugin"
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=10
            )
        self.info, self.service = info, chosen
        return info

    def _call(self, method: str, request: Any, service: str | None) -> Any:
        assert self.info is not None, "register() first"
        _, stub = SERVICES[service or self.service]
        with grpc.insecure_channel(f"unix://{self.info.endpoint}") as channel:
            return getattr(stub(channel), method)(request, timeout=10)

    def prepare(self, claims: list[tuple[str, str, str]], service: str | None = None) -> Any:
        """NodePrepareResources for (namespace, name, uid) triples."""
        pb, _ = SERVICES[service or self.service]
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        return self._call("NodePrepareResources", request, service)

    def unprepare(self, claims: list[tuple[str, str, str]], service: str | None = None) -> Any:
        pb, _ = SERVICES[service or self.service]
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        return self._call("NodeUnprepareResources", request, service)

    def watch_health(self, channel: grpc.Channel) -> Iterator[hpb.NodeWatchResourcesResponse]:
        stub = hpb_grpc.DRAResourceHealthStub(channel)
        return stub.NodeWatchResources(hpb.NodeWatchResourcesRequest(), timeout=30)  # type: ignore[no-any-return]


@dataclass
class DraNode:
    """One node: fixture host copy, DRA plugin, fake API and fake kubelet."""

    host: Path
    root: Path  # short folder holding plugins/, registry/, cdi/
    kube: RunningKubeAPI
    kubelet: FakeDraKubelet
    server: DraServer | None = None

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    def start_plugin(self, health_interval_seconds: float = 0.05) -> DraServer:
        """A plugin over the host polling every 50 ms (by default), believing a recovery at once."""
        custom = kubernetes.client.CustomObjectsApi(self.kube.client())
        server = DraServer(
            make_source(self.host.name, self.host.parent),
            NODE,
            self.root / "plugins",
            self.root / "registry",
            self.cdi_dir,
            KubeClaims(custom),
            policy=HealthPolicy(recovery_seconds=0),
            health_interval_seconds=health_interval_seconds,
            watch_interval_seconds=0.05,
            slices_api=(custom, kubernetes.client.CoreV1Api(self.kube.client())),
        )
        server.start()
        self.server = server
        return server

    def stop_plugin(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def make_claim(
        self, name: str, results: list[dict[str, str]], namespace: str = "ml"
    ) -> tuple[str, str, str]:
        """A ResourceClaim allocated `results` (request, driver, pool, device); (namespace, name, uid)."""
        custom = kubernetes.client.CustomObjectsApi(self.kube.client())
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "xpus", "exactly": {"deviceClassName": DRIVER}}]}},
        }
        created = custom.create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaims", body
        )
        status = {"status": {"allocation": {"devices": {"results": results}}}}
        custom.patch_namespaced_custom_object_status(
            "resource.k8s.io", "v1", namespace, "resourceclaims", name, status
        )
        return namespace, name, created["metadata"]["uid"]

    def slice(self) -> dict[str, Any]:
        (published,) = self.kube.objects("resourceslices", "resource.k8s.io")
        return published


def result(device: str, request: str = "xpus", driver: str = DRIVER, pool: str = NODE) -> dict[str, str]:
    return {"request": request, "driver": driver, "pool": pool, "device": device}


def allocated_resources_status(
    pod_claim: str, request: str, prepared: Any, health: hpb.NodeWatchResourcesResponse
) -> list[dict[str, Any]]:
    """kubelet's `allocatedResourcesStatus` entry for a container using `pod_claim` (its name in the
    pod's `spec.resourceClaims`; `request` '' for the whole claim), prepared as `prepared` (one
    claim's `NodePrepareResourceResponse`), after the stream sent `health`. As kubelet builds it: the
    entry is named ``claim:<pod claim>[/<request>]``; each device the request holds (by its request
    names) gets its health looked up by driver, pool and device name (Unknown when never streamed),
    identified by its first CDI id, else ``<driver>/<pool>/<device>``."""
    streamed = {
        (d.device.pool_name, d.device.device_name): hpb.HealthStatus.Name(d.health).capitalize()
        for d in health.devices
    }
    resources = []
    for device in prepared.devices:
        if request and device.request_names and request not in device.request_names:
            continue
        resource_id = (
            device.cdi_device_ids[0]
            if device.cdi_device_ids
            else f"{DRIVER}/{device.pool_name}/{device.device_name}"
        )
        state = streamed.get((device.pool_name, device.device_name), "Unknown")
        resources.append({"resourceID": resource_id, "health": state})
    name = f"claim:{pod_claim}/{request}" if request else f"claim:{pod_claim}"
    return [{"name": name, "resources": resources}] if resources else []


def random_uid() -> str:
    return str(uuid.uuid4())


@contextmanager
def running_dra_node(
    tmp_path: Path, host_name: str = "p800-8", before_start: Callable[[Path], object] | None = None
) -> Iterator[DraNode]:
    """A `DraNode` over a copy of fixture host `host_name` (changed by `before_start(host)`) with the
    plugin started; all stopped after."""
    host = copy_host(host_name, tmp_path)
    if before_start is not None:
        before_start(host)
    with running_fake_api(tmp_path) as kube, short_tempdir() as root:
        kubernetes.client.CoreV1Api(kube.client()).create_node({"metadata": {"name": NODE}})
        node = DraNode(host, root, kube, FakeDraKubelet(root / "registry"))
        node.start_plugin()
        try:
            yield node
        finally:
            node.stop_plugin()
