"""The node's ResourceSlice (`resource.k8s.io/v1`) as a plain dict: what the scheduler matches.

One slice per node, in a pool named after the node (`resourceSliceCount` 1), one device per healthy
card, named ``xpu-<index>``. Attributes carry no domain prefix, so they belong to the driver's
domain and CEL reads them as ``device.attributes["xpu.kunlun.dev"].<name>``:

==================  =========  ===============================================================
attribute           type       value
==================  =========  ===============================================================
model               string     the product name, e.g. ``P800 OAM``
driverVersion       version    the node's driver, through `to_semver` (``5.0.21.26`` ->
                               ``5.0.21-26``)
firmwareVersion     version    this card's firmware ("ALL Version"), through `to_semver`
kmlVersion          version    the node's KML, through `to_semver`
uuid                string     the card's UUID (the classic plugin's device id)
pciBusID            string     the card's PCI address as sysfs names it, ``0000:52:00.0``
numaNode            int        the card's NUMA node
linkGroup           int        the card's XPU Link group (`kunlun_device.dra.links`)
==================  =========  ===============================================================

Capacity ``memory`` is the card's memory as a quantity (``96Gi``). An attribute whose value is
unknown (no KML, no NUMA node, a version `to_semver` cannot map, a string over 64 characters) is
left out, never filled in: a selector on it does not match that card.

Invariant: pure; the result validates against the Kubernetes 1.34+ `ResourceSlice` schema, and the
same inputs give the same dict (devices by index, attributes in one order).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kunlun_device.dra.semver import to_semver
from kunlun_device.labels import DRA_DRIVER
from kunlun_device.xpu.model import Versions, XpuDevice

API_VERSION = "resource.k8s.io/v1"
MAX_STRING_LENGTH = 64
_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def device_name(index: int) -> str:
    """The name of card `index` in the slice (a DNS label): ``xpu-<index>``."""
    return f"xpu-{index}"


def slice_name(node_name: str) -> str:
    """The name of the node's ResourceSlice: ``<node>-xpu.kunlun.dev``."""
    return f"{node_name}-{DRA_DRIVER}"


def memory_quantity(num_bytes: int) -> str:
    """`num_bytes` as a Kubernetes quantity in the largest binary unit that divides it."""
    for suffix, unit in _BINARY_SUFFIXES:
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)


def pci_bus_id(bus_id: str) -> str | None:
    """`xpu-smi`'s ``00000000:52:00.0`` as sysfs and Kubernetes write it: ``0000:52:00.0``."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep or not domain or not rest:
        return None
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def _string(value: str | None) -> dict[str, str] | None:
    if not value or len(value) > MAX_STRING_LENGTH:
        return None
    return {"string": value}


def _version(value: str | None) -> dict[str, str] | None:
    normal = to_semver(value)
    return {"version": normal} if normal is not None else None


def _int(value: int | None) -> dict[str, int] | None:
    return {"int": value} if value is not None else None


def build_device(device: XpuDevice, versions: Versions, link_group: int | None = None) -> dict[str, Any]:
    """One card as a slice device (see the module docstring for the attributes)."""
    attributes = {
        "model": _string(device.product),
        "driverVersion": _version(versions.driver),
        "firmwareVersion": _version(device.firmware_version),
        "kmlVersion": _version(versions.kml),
        "uuid": _string(device.uuid),
        "pciBusID": _string(pci_bus_id(device.bus_id)),
        "numaNode": _int(device.numa_node),
        "linkGroup": _int(link_group),
    }
    return {
        "name": device_name(device.index),
        "attributes": {name: value for name, value in attributes.items() if value is not None},
        "capacity": {"memory": {"value": memory_quantity(device.memory_total_bytes)}},
    }


def build_resource_slice(
    node_name: str,
    devices: Sequence[XpuDevice],
    versions: Versions,
    *,
    generation: int = 1,
    link_groups: Mapping[int, int] | None = None,
    unhealthy: Collection[int] = (),
    node_uid: str | None = None,
) -> dict[str, Any]:
    """The ResourceSlice of node `node_name`.

    Args:
        node_name: the Node; it names the pool and the slice.
        devices: the node's cards (as discovered).
        versions: the node's driver and KML versions (firmware is read per card).
        generation: the pool generation; the publisher bumps it on every change.
        link_groups: card index -> XPU Link group; None or a missing card: no `linkGroup`.
        unhealthy: indices of cards that are left out of the slice until they recover.
        node_uid: the Node's uid; when given the Node owns the slice (deleted with it).
    Returns:
        The manifest as a dict, devices ordered by card index.
    """
    groups = link_groups or {}
    metadata: dict[str, Any] = {"name": slice_name(node_name)}
    if node_uid is not None:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    listed = [
        build_device(device, versions, groups.get(device.index))
        for device in sorted(devices, key=lambda d: d.index)
        if device.index not in unhealthy
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": DRA_DRIVER,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": listed,
        },
    }
