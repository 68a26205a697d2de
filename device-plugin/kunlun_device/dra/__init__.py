"""The Dynamic Resource Allocation (DRA) kubelet plugin for Kunlun XPUs (driver `xpu.kunlun.dev`).

Beside the classic device plugin and sharing its discovery and health code: it publishes one
ResourceSlice per node (`slices`), answers kubelet's DRAPlugin calls by writing CDI specs
(`cdi`, `prepare`, `checkpoint`) and streams device health (`health`). See docs/device-plugin.md
"DRA". Pure functions decide; `server`, `publisher` and the servicers only do the I/O.
"""
