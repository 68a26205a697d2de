"""Names that the device plugin shares with the rest of the system (the operator imports these).

Invariant: these strings are the contract with Kubernetes objects already in clusters; change them
only together with the operator and the chart.
"""

from __future__ import annotations

import re

#: The extended resource that the device plugin advertises to kubelet.
RESOURCE_NAME = "kunlunxin.com/xpu"

#: Prefix of every node label that the labeler owns (and the only labels it ever touches).
LABEL_PREFIX = "kunlun.dev/xpu."

LABEL_PRESENT = "kunlun.dev/xpu.present"
LABEL_PRODUCT = "kunlun.dev/xpu.product"
LABEL_COUNT = "kunlun.dev/xpu.count"
LABEL_DRIVER_VERSION = "kunlun.dev/xpu.driver-version"
LABEL_FIRMWARE_VERSION = "kunlun.dev/xpu.firmware-version"
LABEL_KML_VERSION = "kunlun.dev/xpu.kml-version"

#: Every label key the labeler manages, in a stable order.
ALL_LABELS: tuple[str, ...] = (
    LABEL_PRESENT,
    LABEL_PRODUCT,
    LABEL_COUNT,
    LABEL_DRIVER_VERSION,
    LABEL_FIRMWARE_VERSION,
    LABEL_KML_VERSION,
)

#: Environment variable that `Allocate` sets to the comma-separated host indices of the cards.
VISIBLE_DEVICES_ENV = "XPU_VISIBLE_DEVICES"

#: Control device node handed to every container that gets at least one card.
CONTROL_DEVICE = "/dev/xpuctrl"

#: Pod condition the node agent sets on every pod holding a card: "False" while one of its cards is
#: Unhealthy or quarantined, "True" again when they all are Healthy. Runtime pods carry a readiness
#: gate on it (the operator), so a pod on a failed card leaves its Service at once.
XPU_HEALTHY_CONDITION = "kunlun.dev/xpu-healthy"

#: `message` of that condition (and of the Events): "node <node>: " then each failed card as
#: `xpu_card_name` gives it, with its failed checks. The operator reads the card indices back with
#: `XPU_CARD_IN_MESSAGE` to name the card in its status and Events.
XPU_CARD_IN_MESSAGE = re.compile(r"\bxpu(\d+) \(")


def xpu_card_name(index: int, uuid: str) -> str:
    """A card as condition messages and Events name it: ``xpu5 (GPU-...)``."""
    return f"xpu{index} ({uuid})"


#: `reason` of that condition and of the Events posted on the pod.
REASON_XPU_UNHEALTHY = "XpuUnhealthy"
REASON_XPU_QUARANTINED = "XpuQuarantined"
REASON_XPU_HEALTHY = "XpuHealthy"

#: Node annotation: comma-separated UUIDs of the node's quarantined cards. The node agent adds a
#: card after it failed `--quarantine-failures` times within `--quarantine-window-seconds`; an
#: operator re-admits a card by removing its UUID (or the whole annotation).
QUARANTINE_ANNOTATION = "kunlun.dev/xpu-quarantine"

#: Node annotation: each card's recent failures (Unix seconds), owned by the node agent, so that a
#: restarted agent keeps counting towards the quarantine. A versioned JSON document
#: (`kunlun_device.faults.history`); an operator may remove it to reset every count.
FAILURES_ANNOTATION = "kunlun.dev/xpu-failures"

#: NoSchedule taint the node agent puts on a node whose cards are all Unhealthy (when enabled).
UNHEALTHY_TAINT = "kunlun.dev/xpu-unhealthy"

#: The DRA driver name (`kunlun-device-plugin dra`): the driver of our ResourceSlices and of the
#: `xpu.kunlun.dev` DeviceClass, and the domain of every device attribute we publish (CEL reads
#: them as ``device.attributes["xpu.kunlun.dev"].<name>``).
DRA_DRIVER = "xpu.kunlun.dev"
