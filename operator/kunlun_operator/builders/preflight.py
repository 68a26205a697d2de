"""The Strict preflight init container and the node files it mounts.

Owns: ``kunlun-runtime preflight`` as an init container of the runtime pod (policy ``Strict`` only).
It re-checks on the node that the driver, firmware and KML are the locked versions before the model
loads. It requests the same number of cards as the runtime, so kubelet hands it the same device
nodes (``/dev/xpuN``, ``/dev/xpuctrl``) and ``XPU_VISIBLE_DEVICES`` from the device plugin's
``Allocate``; with ``claimed`` cards it shares the pod's ResourceClaim instead, so the DRA plugin's
CDI spec injects the same device nodes and ``XPU_VISIBLE_DEVICES`` into it. It mounts the directory
of the node's KML version file (so a node without the file reaches preflight, whose error names it,
instead of stopping at kubelet's mount) and, when configured, the node's ``xpu-smi`` (read-only
``hostPath`` volumes), and passes their paths as flags (``PreflightHost``, the operator's
``--preflight-*`` flags).
"""

from __future__ import annotations

import posixpath
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import RESTRICTED_CONTAINER
from kunlun_operator.builders.resource_claim import CONTAINER_CLAIMS
from kunlun_operator.spec.operator_config import PreflightHost
from kunlun_operator.spec.values import InferenceSpec

#: Where the preflight container sees the node's files (hostPath mounts, read-only): the KML version
#: file's directory at its host path under this root (so preflight's error shows the host path),
#: ``xpu-smi`` at a fixed path.
PREFLIGHT_HOST_ROOT = "/run/kunlun-host"
PREFLIGHT_XPU_SMI_PATH = "/run/kunlun-host/bin/xpu-smi"
PREFLIGHT_KML_VOLUME = "host-kml-version"
PREFLIGHT_XPU_SMI_VOLUME = "host-xpu-smi"


def preflight_kml_mount(host_file: str) -> tuple[str, str]:
    """``(host directory, its mount path)`` of the KML version file ``host_file``: the directory
    at its own path under ``PREFLIGHT_HOST_ROOT``. The file is then at ``mount path/basename``."""
    directory = posixpath.dirname(host_file.rstrip("/"))
    return directory, PREFLIGHT_HOST_ROOT + directory


def preflight_kml_path(host_file: str) -> str:
    """Where the preflight container reads the node's KML version file ``host_file``."""
    return PREFLIGHT_HOST_ROOT + host_file.rstrip("/")


def build_preflight_container(
    spec: InferenceSpec, image: str, host: PreflightHost, *, claimed: bool = False
) -> dict[str, Any]:
    """``kunlun-runtime preflight`` on the cards kubelet allocates to it (``claimed``: the pod's
    ResourceClaim's), with the node's files.

    Raises:
        SpecError: a version is unset (only possible under policy Off, which has no preflight).
    """
    driver, firmware, kml = spec.versions.locked_versions()
    xpus = str(spec.resources.xpus)
    args = [
        "preflight",
        "--expect-driver",
        driver,
        "--expect-firmware",
        firmware,
        "--expect-kml",
        kml,
        "--min-cards",
        xpus,
        "--require-allocation",
        "--dev-root",
        "/",
    ]
    mounts = []
    if host.kml_version_file is not None:
        args += ["--kml-version-file", preflight_kml_path(host.kml_version_file)]
        _, mount_path = preflight_kml_mount(host.kml_version_file)
        mounts.append({"name": PREFLIGHT_KML_VOLUME, "mountPath": mount_path, "readOnly": True})
    if host.xpu_smi is not None:
        args += ["--xpu-smi", PREFLIGHT_XPU_SMI_PATH]
        mounts.append(
            {"name": PREFLIGHT_XPU_SMI_VOLUME, "mountPath": PREFLIGHT_XPU_SMI_PATH, "readOnly": True}
        )
    return {
        "name": "preflight",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kunlun-runtime"],
        "args": args,
        "resources": {"claims": [dict(c) for c in CONTAINER_CLAIMS]}
        if claimed
        else {"requests": {names.RESOURCE_NAME: xpus}, "limits": {names.RESOURCE_NAME: xpus}},
        "securityContext": dict(RESTRICTED_CONTAINER),
        **({"volumeMounts": mounts} if mounts else {}),
    }


def build_preflight_volumes(host: PreflightHost) -> list[dict[str, Any]]:
    """The pod's ``hostPath`` volumes of the node files in ``host`` (none when both are unset)."""
    volumes = []
    if host.kml_version_file is not None:
        # The directory, with no type check (""): a node without it gets an empty one from the
        # container runtime, and preflight reports the missing file by name.
        directory, _ = preflight_kml_mount(host.kml_version_file)
        volumes.append({"name": PREFLIGHT_KML_VOLUME, "hostPath": {"path": directory, "type": ""}})
    if host.xpu_smi is not None:
        volumes.append({"name": PREFLIGHT_XPU_SMI_VOLUME, "hostPath": {"path": host.xpu_smi, "type": "File"}})
    return volumes
