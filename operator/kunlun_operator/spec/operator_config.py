"""The operator's own configuration that shapes what it builds, parsed once into typed values.

Owns: ``PreflightHost``, the node files the Strict preflight mounts (``run`` flags
``--preflight-kml-version-file`` and ``--preflight-xpu-smi``), and their checks; ``PickerImages``,
the Endpoint Picker images of routed services (``--endpoint-picker-image``,
``--precise-endpoint-picker-image``, ``--precise-tokenizer-image``). Not the custom
resource (``service``): these come from the cluster admin, the same for every service. Must not
read flags or files itself: the shell (``shell/cli.py``) hands the flag values in. Invariant: a
``PreflightHost`` from ``parse_preflight_host`` never mounts the node's root directory.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from kunlun_operator import names

KML_VERSION_FILE_FLAG = "--preflight-kml-version-file"
XPU_SMI_FLAG = "--preflight-xpu-smi"


@dataclass(frozen=True, slots=True)
class PreflightHost:
    """The node's files the preflight init container mounts (operator flags ``--preflight-*``)."""

    #: Host path of the KML version file; its directory is mounted (``hostPath`` without a type
    #: check), so a node without the file starts the preflight, which fails naming the file;
    #: None: no hostPath at all, preflight reads the image's own KML version file (namespaces
    #: enforcing the Pod Security "baseline" or "restricted" level refuse every hostPath volume).
    kml_version_file: str | None = names.HOST_KML_VERSION_FILE
    #: Host path of the node agent's ``xpu-smi`` (``hostPath`` of type File); None: the image's own
    #: (``xpu-smi`` on its PATH, or ``$KUNLUN_XPU_SMI``).
    xpu_smi: str | None = None


#: The operator's defaults: the labeler's KML version file, the image's own xpu-smi.
DEFAULT_PREFLIGHT_HOST = PreflightHost()


@dataclass(frozen=True, slots=True)
class PickerImages:
    """The Endpoint Picker images of services with ``spec.routing.type: InferencePool`` that name
    none (``spec.routing.picker.image``): always allowed, whatever the admission policy says."""

    #: The Gateway API Inference Extension's picker (approximate prefix routing).
    endpoint_picker: str = names.DEFAULT_ENDPOINT_PICKER_IMAGE
    #: llm-d's picker, whose indexer reads the pods' KV events (``spec.routing.precise``).
    precise_endpoint_picker: str = names.DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE
    #: The tokenizer sidecar of a precise picker (llm-d's UDS tokenizer), whatever picker image it runs.
    precise_tokenizer: str = names.DEFAULT_PRECISE_TOKENIZER_IMAGE

    def for_precise(self, precise: bool) -> str:
        return self.precise_endpoint_picker if precise else self.endpoint_picker


#: The operator's defaults: the published pickers of the versions it is tested against.
DEFAULT_PICKER_IMAGES = PickerImages()


def parse_preflight_host(kml_version_file: str, xpu_smi: str) -> PreflightHost:
    """The node files of the flag values ``kml_version_file`` and ``xpu_smi`` (empty: none).

    Raises:
        ValueError: a path is not absolute (a hostPath requires it), or the KML version file's
            directory, which is what gets mounted, could be the node's root; the message names the flag.
    """
    for flag, value in ((KML_VERSION_FILE_FLAG, kml_version_file), (XPU_SMI_FLAG, xpu_smi)):
        if value and not value.startswith("/"):
            raise ValueError(f"{flag} must be an absolute host path, got {value!r}")
    if kml_version_file:
        _check_kml_version_file(kml_version_file)
    return PreflightHost(kml_version_file=kml_version_file or None, xpu_smi=xpu_smi or None)


def _check_kml_version_file(path: str) -> None:
    """Its directory is what the preflight mounts: never the node's whole root. So the path must be
    normal (no ``.``, ``..`` or empty segment: ``/./VERSION``, ``//VERSION`` and ``/etc/../VERSION``
    all name a file of ``/``) and its directory other than ``/``; the chart's schema says the same."""
    segments = path.split("/")[1:]
    if posixpath.normpath(path) != path or any(s in ("", ".", "..") for s in segments):
        raise ValueError(
            f"{KML_VERSION_FILE_FLAG} must be a normal absolute path "
            f"(no '.', '..' or empty segment), got {path!r}"
        )
    if len(segments) < 2:
        raise ValueError(f"{KML_VERSION_FILE_FLAG} must be in a directory other than /, got {path!r}")
