"""Node labeler: writes `kunlun.dev/xpu.*` labels (presence, product, count, versions)."""

from kunlun_device.labeler.labeler import NodeLabeler
from kunlun_device.labeler.values import build_labels, label_safe

__all__ = ["NodeLabeler", "build_labels", "label_safe"]
