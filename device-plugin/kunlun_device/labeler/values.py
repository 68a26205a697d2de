"""The node labels the labeler wants, computed from discovery and versions (pure functions).

Invariant: every value is a valid Kubernetes label value (at most 63 characters of
`[A-Za-z0-9._-]`, alphanumeric at both ends) or None, which means "remove this label".
"""

from __future__ import annotations

import re
from collections import Counter

from kunlun_device.labels import (
    LABEL_COUNT,
    LABEL_DRIVER_VERSION,
    LABEL_FIRMWARE_VERSION,
    LABEL_KML_VERSION,
    LABEL_PRESENT,
    LABEL_PRODUCT,
)
from kunlun_device.xpu.model import Versions, XpuDevice

MAX_VALUE_LENGTH = 63
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def label_safe(text: str | None) -> str | None:
    """`text` as a label value: unsafe runs become `-`, ends trimmed, cut to 63; None if nothing is left."""
    if text is None:
        return None
    value = _EDGE.sub("", _UNSAFE.sub("-", text.strip()))
    value = _EDGE.sub("", value[:MAX_VALUE_LENGTH])
    return value or None


def build_labels(devices: tuple[XpuDevice, ...], versions: Versions) -> dict[str, str | None]:
    """The desired value of every label the labeler owns (None: the label must not exist).

    The product is the most common product name (a node normally has one kind of card).
    """
    if not devices:
        return {
            LABEL_PRESENT: "false",
            LABEL_PRODUCT: None,
            LABEL_COUNT: "0",
            LABEL_DRIVER_VERSION: None,
            LABEL_FIRMWARE_VERSION: None,
            LABEL_KML_VERSION: None,
        }
    product = Counter(device.product for device in devices).most_common(1)[0][0]
    return {
        LABEL_PRESENT: "true",
        LABEL_PRODUCT: label_safe(product),
        LABEL_COUNT: str(len(devices)),
        LABEL_DRIVER_VERSION: label_safe(versions.driver),
        LABEL_FIRMWARE_VERSION: label_safe(versions.firmware),
        LABEL_KML_VERSION: label_safe(versions.kml),
    }


def label_patch(current: dict[str, str], desired: dict[str, str | None]) -> dict[str, str | None]:
    """The merge-patch `metadata.labels` entries that turn `current` into `desired` (only owned keys)."""
    return {key: value for key, value in desired.items() if current.get(key) != value}
