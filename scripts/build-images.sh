#!/usr/bin/env bash
# Build the container images with podman from a Debian base bootstrapped on this machine (no
# registry is needed: the base is made with debootstrap and imported once, then reused).
#
#   scripts/build-images.sh [--versions FILE] [--kunlun-stack DIR] [--kunlun-tag IMAGE] [--only NAMES]
#
#   localhost/kunlun-runtime:cpu          runtime, CPU PyTorch from runtime/requirements.lock
#   localhost/kunlun-runtime:kunlun       runtime on the vendor stack in DIR (also tagged with
#                                         kunlunStack.imageTag); only with --kunlun-stack or KUNLUN_STACK
#   localhost/kunlun-operator:dev         the operator
#   localhost/kunlun-device-plugin:dev    the device plugin, xpu-smi mounted from the host
#   localhost/kunlun-common:dev, localhost/kunlun-package:dev
#                                         what the three share (images/common.Dockerfile), first
#
# --only takes a comma-separated subset of: base, cpu, kunlun, operator, device-plugin.
# --kunlun-tag IMAGE tags the kunlun variant IMAGE alone (tests use it for their fake stack).
# --versions FILE (or KUNLUN_VERSIONS) reads kunlunStack (versions, checksums) from FILE instead of versions.yaml: the
# certified entry lists no checksums until a vendor stack is received, and a stack whose files are
# not all listed with their sha256 is refused.
# Idempotent: podman's layer cache is kept, so a second run rebuilds only what changed.
# Environment: PYTHON (a Python with PyYAML, default .venv/bin/python), WHEELS (a folder holding
# the CPU torch wheel, default the first entry of PIP_FIND_LINKS, else /opt/wheels), DEBIAN_MIRROR.
set -euo pipefail
# One build at a time per checkout (flock, where there is one): CI starts the build in the
# background, and the image tests, which build what they need from the layer cache, wait for it.
if [ -z "${KUNLUN_IMAGES_LOCKED:-}" ] && command -v flock >/dev/null; then
    lock_dir="$(cd "$(dirname "$0")/.." && pwd)/.tools"
    mkdir -p "$lock_dir"
    exec env KUNLUN_IMAGES_LOCKED=1 flock "$lock_dir/build-images.lock" bash "$0" "$@"
fi
caller=$PWD
absolute() { case "$1" in /*|"") echo "$1" ;; *) echo "$caller/$1" ;; esac; }
cd "$(dirname "$0")/.."

versions=$(absolute "${KUNLUN_VERSIONS:-versions.yaml}")
stack=$(absolute "${KUNLUN_STACK:-}")
only=""
kunlun_tag=""
while [ $# -gt 0 ]; do
    case "$1" in
        --versions) versions=$(absolute "$2"); shift 2 ;;
        --kunlun-stack) stack=$(absolute "$2"); shift 2 ;;
        --only) only=$2; shift 2 ;;
        --kunlun-tag) kunlun_tag=$2; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "build-images: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -z "$only" ]; then
    only="cpu,operator,device-plugin"
    [ -n "$stack" ] && only="$only,kunlun"
fi
wanted() { case ",$only," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

python=${PYTHON:-.venv/bin/python}
wheels=${WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}
wheels=${wheels%% *}
base=localhost/kunlun-base:bookworm
version=$("$python" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["project"]["version"])' versions.yaml)

# crun fails on these machines (cgroups in hybrid mode, setrlimit): runc and no default ulimits.
mkdir -p .tools
if [ -z "${CONTAINERS_CONF:-}" ]; then
    printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' > .tools/containers.conf
    export CONTAINERS_CONF="$PWD/.tools/containers.conf"
fi
# The host's CA bundle, so a build behind a TLS-intercepting proxy (whose CA only the host trusts)
# reaches the package registries as the host does.
ca=/etc/ssl/certs/ca-certificates.crt
common=(--network host --layers)
[ -f "$ca" ] && common+=(-v "$ca:$ca:ro")

timed() {  # timed NAME COMMAND...: run, then print how long it took
    local start=$SECONDS
    "${@:2}"
    echo "build-images: $1 built in $((SECONDS - start)) s"
}

bootstrap_base() {
    if podman image exists "$base"; then
        echo "build-images: $base exists (podman rmi it to bootstrap again)"
        return
    fi
    # The mirror this machine's apt already uses, so the base sees the same archive.
    local mirror=${DEBIAN_MIRROR:-$(grep -rhoE '(URIs:|deb) +https?://[^ ]+/debian/?( |$)' \
        /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null | head -n1 | awk '{print $2}')}
    mirror=${mirror:-http://deb.debian.org/debian}
    local rootfs
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$mirror"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$base"
    rm -rf "$rootfs"
}

# The stack's checksums from the versions file, as a sha256sum list in a folder of its own (a
# second build context: the Dockerfile checks the stack against it too).
stack_sums() {
    "$python" - "$versions" "$stack" "$1" <<'PY'
import hashlib, sys
from pathlib import Path

import yaml

versions_file, stack, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
listed = (yaml.safe_load(open(versions_file)).get("kunlunStack") or {}).get("sha256") or {}
fail = lambda why: sys.exit(f"build-images: kunlun stack {stack}: {why}")
if not stack.is_dir():
    fail("no such folder (KUNLUN_STACK / --kunlun-stack must name the unpacked vendor stack)")
if not listed:
    fail(f"{versions_file} lists no sha256 under kunlunStack.sha256; a stack nobody certified is "
         "not built (point --versions at a file that lists this stack's checksums)")
found = {p.relative_to(stack).as_posix() for p in stack.rglob("*") if p.is_file()}
problems = [f"{name}: listed but missing" for name in sorted(set(listed) - found)]
problems += [f"{name}: not listed in {versions_file}" for name in sorted(found - set(listed))]
for name in sorted(found & set(listed)):
    digest = hashlib.sha256((stack / name).read_bytes()).hexdigest()
    if digest != listed[name]:
        problems.append(f"{name}: sha256 {digest}, {versions_file} lists {listed[name]}")
for required in ("bin/xpu-smi", "kml/VERSION"):
    if required not in found:
        problems.append(f"{required}: required, missing")
if not any(name.startswith("wheels/torch-") and name.endswith(".whl") for name in found):
    problems.append("wheels/: no torch wheel (Kunlun's PyTorch build)")
if not any(name.startswith("lib/") for name in found):
    problems.append("lib/: no runtime library")
if problems:
    fail("does not match the certified stack:\n  " + "\n  ".join(problems))
out.mkdir(parents=True, exist_ok=True)
(out / "SHA256SUMS").write_text("".join(f"{listed[n]}  {n}\n" for n in sorted(listed)))
PY
}

stack_value() {
    "$python" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["kunlunStack"][sys.argv[2]])' \
        "$versions" "$1"
}

# The vendor stack is checked first: a stack that would be refused costs no build.
if wanted kunlun; then
    [ -n "$stack" ] || { echo "build-images: kunlun: set KUNLUN_STACK or --kunlun-stack" >&2; exit 2; }
    sums=$(mktemp -d)
    trap 'rm -rf "$sums"' EXIT
    stack_sums "$sums"
fi
if wanted base || ! podman image exists "$base"; then timed base bootstrap_base; fi
# The base the three images share and our package's wheel: built once, before any image (podman's
# layer cache makes this seconds when nothing changed), and handed to each as a build argument.
common_image=localhost/kunlun-common:dev
package_image=localhost/kunlun-package:dev
timed common podman build "${common[@]}" --build-arg "PYTHON_IMAGE=$base" \
    -f images/common.Dockerfile --target common -t "$common_image" .
timed package podman build "${common[@]}" --build-arg "PYTHON_IMAGE=$base" \
    -f images/common.Dockerfile --target package -t "$package_image" .
from=(--build-arg "COMMON_IMAGE=$common_image" --build-arg "PACKAGE_IMAGE=$package_image")
# The local CPU torch wheel, when there is one; without it the lock's URL is used.
[ -d "$wheels" ] && from+=(-v "$wheels:/wheels:ro")

# The operator and the device plugin build beside the runtime (their pip installs mostly wait on
# the network while the runtime's kernels compile): each into a log of its own, printed when done.
side_logs=$(mktemp -d)
side_builds=()
beside() {  # beside NAME COMMAND...: run in the background, output to NAME's log
    local name=$1
    shift
    "$@" > "$side_logs/$name.log" 2>&1 &
    side_builds+=("$name:$!")
}
if wanted operator; then
    beside operator timed operator podman build "${common[@]}" "${from[@]}" \
        -f operator/Dockerfile -t localhost/kunlun-operator:dev .
fi
if wanted device-plugin; then
    beside device-plugin timed device-plugin podman build "${common[@]}" "${from[@]}" \
        -f device-plugin/Dockerfile --target host-xpu-smi -t localhost/kunlun-device-plugin:dev .
fi
if wanted cpu; then
    timed runtime:cpu podman build "${common[@]}" "${from[@]}" \
        -f runtime/Dockerfile --target cpu -t localhost/kunlun-runtime:cpu .
fi
if wanted kunlun; then
    tags=(-t localhost/kunlun-runtime:kunlun -t "localhost/kunlun-runtime:$(stack_value imageTag)")
    [ -n "$kunlun_tag" ] && tags=(-t "$kunlun_tag")
    timed runtime:kunlun podman build "${common[@]}" "${from[@]}" \
        --build-context "kunlun-stack=$stack" --build-context "kunlun-stack-sums=$sums" \
        --build-arg "KUNLUN_XRE_VERSION=$(stack_value xre)" \
        --build-arg "KUNLUN_KML_VERSION=$(stack_value kml)" \
        --build-arg "KUNLUN_DRIVER_VERSION=$(stack_value driver)" \
        -f runtime/Dockerfile --target kunlun "${tags[@]}" .
fi
failed=""
for build in "${side_builds[@]}"; do
    name=${build%%:*}
    status=0
    wait "${build#*:}" || status=$?
    cat "$side_logs/$name.log"
    [ "$status" = 0 ] || failed="$failed $name"
done
rm -rf "$side_logs"
if [ -n "$failed" ]; then
    echo "build-images: failed:$failed" >&2
    exit 1
fi
echo "build-images: version $version done"
