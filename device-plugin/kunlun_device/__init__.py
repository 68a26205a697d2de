"""Kunlun XPUs in Kubernetes: device plugin, node labeler and chip exporter (no torch import).

Layers (import-linter): `cli` > `plugin` | `labeler` | `exporter` > `xpu` (the only code that reads
the hardware) > `api` (generated kubelet gRPC code). Shared names: `labels`; errors: `errors`.
"""
