#!/usr/bin/env bash
# Copy the sources of truth the Helm chart cannot read from outside its own folder into it:
#   crds/*.yaml    -> charts/kunlun-inference/crds/   (the CRD, byte for byte)
#   versions.yaml  -> charts/kunlun-inference/files/versions.yaml (compatibility matrix, alerts)
# CI (tests/chart/test_sync.py) fails when a copy differs; run this script and commit the result.
# Chart-only CRDs (kopf's peering CRD) are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
chart=charts/kunlun-inference
mkdir -p "$chart/crds" "$chart/files"
shopt -s nullglob
for crd in crds/*.yaml; do
    cp -f "$crd" "$chart/crds/$(basename "$crd")"
    echo "sync-crd: $crd -> $chart/crds/$(basename "$crd")"
done
cp -f versions.yaml "$chart/files/versions.yaml"
echo "sync-crd: versions.yaml -> $chart/files/versions.yaml"
