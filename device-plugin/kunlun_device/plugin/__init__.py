"""The Kubernetes device plugin for Kunlun XPUs (resource `kunlunxin.com/xpu`)."""

from kunlun_device.plugin.server import PluginServer

__all__ = ["PluginServer"]
