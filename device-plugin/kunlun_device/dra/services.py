"""The gRPC services kubelet calls: DRAPlugin (v1 and v1beta1) and plugin Registration.

Thin: requests become `ClaimRef`s, `DraDriver` decides, its results become responses. Both DRAPlugin
versions carry the same messages, so one servicer class serves either, given the version's
generated module. Registration answers the plugin watcher: type `DRAPlugin`, the driver name, the
DRA socket's absolute path and the services served, by the names kubelet knows them
(`SUPPORTED_SERVICES`); `NotifyRegistrationStatus` is logged and counted, and a successful one
calls `on_registered` (the server then checks its ResourceSlice at once).

Invariant: a bad claim never makes a call fail: it gets its own `error`; every claim of a request
gets an entry in the response.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc

from kunlun_device.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from kunlun_device.api import pluginregistration_v1_pb2 as reg
from kunlun_device.api import pluginregistration_v1_pb2_grpc as reg_grpc
from kunlun_device.dra.allocation import ClaimRef
from kunlun_device.dra.driver import DraDriver
from kunlun_device.labels import DRA_DRIVER

logger = logging.getLogger(__name__)
PLUGIN_TYPE = "DRAPlugin"
#: The names kubelet matches in `supported_versions`, newest first.
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


class DraPluginServicer:
    """`DRAPlugin` of one API version (`pb` is its generated `*_pb2` module)."""

    def __init__(self, driver: DraDriver, pb: ModuleType) -> None:
        self._driver = driver
        self._pb = pb

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        pb = self._pb
        results = self._driver.prepare(_refs(request))
        claims = {
            uid: pb.NodePrepareResourceResponse(
                devices=[
                    pb.Device(
                        request_names=list(d.request_names),
                        pool_name=d.pool_name,
                        device_name=d.device_name,
                        cdi_device_ids=list(d.cdi_device_ids),
                    )
                    for d in result.devices
                ],
                error=result.error,
            )
            for uid, result in results.items()
        }
        return pb.NodePrepareResourcesResponse(claims=claims)

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        pb = self._pb
        errors = self._driver.unprepare(_refs(request))
        claims = {uid: pb.NodeUnprepareResourceResponse(error=error) for uid, error in errors.items()}
        return pb.NodeUnprepareResourcesResponse(claims=claims)


def add_dra_services(server: grpc.Server, driver: DraDriver) -> None:
    """Serve DRAPlugin v1 and v1beta1 on `server`."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(driver, dra_v1_pb2), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(driver, dra_v1beta1_pb2), server)


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """What the kubelet plugin watcher asks on the registration socket."""

    def __init__(self, endpoint: str, on_registered: Callable[[], object] | None = None) -> None:
        self._endpoint = endpoint
        self._on_registered = on_registered
        self._lock = threading.Lock()
        self.notifications: list[tuple[bool, str]] = []

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRA_DRIVER,
            endpoint=self._endpoint,
            supported_versions=list(SUPPORTED_SERVICES),
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        with self._lock:
            self.notifications.append((request.plugin_registered, request.error))
        if request.plugin_registered:
            logger.info("kubelet registered DRA driver %s (%s)", DRA_DRIVER, self._endpoint)
            if self._on_registered is not None:
                self._on_registered()
        else:
            logger.error("kubelet refused DRA driver %s: %s", DRA_DRIVER, request.error or "no reason given")
        return reg.RegistrationStatusResponse()
