"""Prometheus exporter of Kunlun chip metrics, attributed to pods through kubelet PodResources."""

from kunlun_device.exporter.server import Exporter

__all__ = ["Exporter"]
