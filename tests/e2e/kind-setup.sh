#!/usr/bin/env bash
# Make a throwaway kind cluster for the operator's e2e tests (tests/e2e), where Docker exists.
#
#   tests/e2e/kind-setup.sh            # create (or reuse) the cluster, print the KUBECONFIG line
#   LWS_VERSION=v0.8.0 tests/e2e/kind-setup.sh   # also install LeaderWorkerSet (multi-node e2e case)
#   tests/e2e/kind-setup.sh --delete   # remove it
#
# Needs docker and kind (https://kind.sigs.k8s.io) on PATH; kubectl is optional. The cluster has
# no Kunlun cards: the script labels the worker as the device plugin's labeler would (locked
# versions of the shipped compatibility matrix) so that the version lock can be exercised; the
# runtime pods stay Pending (no kunlunxin.com/xpu capacity), which the tests expect.
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME="${KIND_CLUSTER_NAME:-kunlun-e2e}"
IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.31.0}"
KUBECONFIG_OUT="${KUBECONFIG_OUT:-$PWD/.cache/kind-$NAME.kubeconfig}"

for tool in docker kind; do
    command -v "$tool" >/dev/null || { echo "kind-setup: '$tool' not found on PATH" >&2; exit 2; }
done
docker info >/dev/null 2>&1 || { echo "kind-setup: the Docker engine is not reachable" >&2; exit 2; }

if [[ "${1:-}" == "--delete" ]]; then
    kind delete cluster --name "$NAME"
    rm -f "$KUBECONFIG_OUT"
    exit 0
fi

mkdir -p "$(dirname "$KUBECONFIG_OUT")"
if ! kind get clusters | grep -qx "$NAME"; then
    cat <<YAML | kind create cluster --name "$NAME" --image "$IMAGE" --wait 120s --config -
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    labels:
      kunlun.dev/xpu.present: "true"
      kunlun.dev/xpu.product: P800
      kunlun.dev/xpu.count: "8"
      kunlun.dev/xpu.driver-version: "5.0.21.26"
      kunlun.dev/xpu.firmware-version: "1.0.2.14.1.54"
      kunlun.dev/xpu.kml-version: "3.2.0"
YAML
fi
kind get kubeconfig --name "$NAME" > "$KUBECONFIG_OUT"
if [[ -n "${LWS_VERSION:-}" ]]; then
    # LeaderWorkerSet's own release manifest (https://lws.sigs.k8s.io/docs/installation/); needs kubectl.
    command -v kubectl >/dev/null || { echo "kind-setup: LWS_VERSION needs 'kubectl' on PATH" >&2; exit 2; }
    kubectl --kubeconfig "$KUBECONFIG_OUT" apply --server-side \
        -f "https://github.com/kubernetes-sigs/lws/releases/download/$LWS_VERSION/manifests.yaml"
    kubectl --kubeconfig "$KUBECONFIG_OUT" wait deploy/lws-controller-manager -n lws-system \
        --for=condition=available --timeout=5m
fi
echo "kind-setup: cluster '$NAME' ready. Run the e2e tests with:"
echo "  KUBECONFIG=$KUBECONFIG_OUT .venv/bin/pytest -q tests/e2e"
