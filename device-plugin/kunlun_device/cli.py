"""Console entry point `kunlun-device-plugin plugin|dra|labeler|exporter` (see docs/device-plugin.md).

Parses flags, builds the source (`XpuSource`, or for the labeler and the exporter with
`--source snapshot:PATH` a `SnapshotSource` over the plugin's node snapshot) and the component, runs
it until SIGTERM/SIGINT. Exit status: 0 after a clean stop, 1 when the hardware or the API failed at
start or no API configuration is usable (the message names what is missing), 2 on bad flags. From a
snapshot the exporter waits for a usable one instead of exiting 1 (the plugin, in the same pod, may
not have written it yet).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kunlun_device.errors import ApiConfigError, ConfigError, XpuError
from kunlun_device.xpu.health import HealthPolicy, parse_severities
from kunlun_device.xpu.reader import XpuReader
from kunlun_device.xpu.snapshot_source import SnapshotSource
from kunlun_device.xpu.source import DEFAULT_KML_VERSION_FILE, XpuSource

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from kunlun_device.plugin.server import RoundHook
    from kunlun_device.xpu.model import XpuDevice

logger = logging.getLogger("kunlun_device")
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
SNAPSHOT_PREFIX = "snapshot:"
SNAPSHOT_RETRY_SECONDS = 2.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _common(health: bool) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--xpu-smi", default="xpu-smi", metavar="PATH", help="the xpu-smi command")
    parent.add_argument("--dev-root", default="/", metavar="DIR", help="where the host's dev/ and sys/ are")
    parent.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="default: $NODE_NAME")
    parent.add_argument(
        "--kml-version-file",
        default=DEFAULT_KML_VERSION_FILE,
        metavar="PATH",
        help="host path (under --dev-root) of the KML version, text or JSON {kml_version}; '' disables",
    )
    parent.add_argument("--xpu-smi-timeout", type=_positive, default=10.0, metavar="SECONDS", help="per call")
    parent.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    if health:
        parent.add_argument(
            "--health-interval", type=_positive, default=10.0, metavar="SECONDS", help="poll period"
        )
        parent.add_argument(
            "--recovery-seconds",
            type=float,
            default=60.0,
            metavar="SECONDS",
            help="fault-free time to be Healthy",
        )
        parent.add_argument("--temperature-warn-celsius", type=float, default=85.0, metavar="C")
        parent.add_argument("--temperature-critical-celsius", type=float, default=95.0, metavar="C")
        parent.add_argument(
            "--health-policy",
            default="",
            metavar="CHECK=SEVERITY,...",
            help="severity overrides (ignore|warn|unhealthy)",
        )
    return parent


def _reading() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--source",
        default="xpu-smi",
        metavar="xpu-smi|snapshot:PATH",
        help="run xpu-smi (needs the device nodes) or read the plugin's node snapshot",
    )
    parent.add_argument(
        "--snapshot-max-age",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="oldest usable snapshot (default: 3 plugin health intervals, at least 90)",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kunlun-device-plugin", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plugin = commands.add_parser("plugin", parents=[_common(True)], help="kubelet device plugin")
    plugin.add_argument(
        "--kubelet-dir", default="/var/lib/kubelet/device-plugins", metavar="DIR", help="holds kubelet.sock"
    )
    plugin.add_argument(
        "--socket-name", default="kunlun-xpu.sock", metavar="NAME", help="the plugin's socket"
    )
    faults = plugin.add_argument_group("fault response (pod conditions, Events, quarantine, taint)")
    faults.add_argument("--respond-to-faults", action="store_true", help="tell pods on failed cards")
    faults.add_argument(
        "--kubeconfig", default=None, metavar="PATH", help="default: in-cluster, else KUBECONFIG"
    )
    faults.add_argument(
        "--pod-resources-socket",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metavar="PATH",
        help="kubelet PodResources",
    )
    faults.add_argument(
        "--quarantine-failures", type=int, default=3, metavar="K", help="failures that quarantine"
    )
    faults.add_argument(
        "--quarantine-window-seconds",
        type=_positive,
        default=600.0,
        metavar="SECONDS",
        help="counting window",
    )
    faults.add_argument(
        "--node-sync-seconds", type=_positive, default=30.0, metavar="SECONDS", help="re-read the quarantine"
    )
    faults.add_argument(
        "--taint-when-all-unhealthy", action="store_true", help="NoSchedule taint on dead nodes"
    )
    faults.add_argument("--quarantine-file", default="", metavar="PATH", help="where the exporter reads it")
    faults.add_argument(
        "--state-file",
        default="",
        metavar="PATH",
        help="node-local last-known quarantine and failure counts, held until the Node is read; '' none",
    )
    plugin.add_argument(
        "--snapshot-file",
        default="",
        metavar="PATH",
        help="write the node snapshot here every round (read by labeler/exporter --source snapshot:PATH)",
    )
    dra = commands.add_parser("dra", parents=[_common(True)], help="DRA kubelet plugin (xpu.kunlun.dev)")
    dra.add_argument(
        "--plugins-dir", default="/var/lib/kubelet/plugins", metavar="DIR", help="the DRA socket's parent"
    )
    dra.add_argument(
        "--registry-dir",
        default="/var/lib/kubelet/plugins_registry",
        metavar="DIR",
        help="kubelet's plugin watcher directory",
    )
    dra.add_argument("--cdi-dir", default="/var/run/cdi", metavar="DIR", help="where CDI specs are written")
    dra.add_argument(
        "--checkpoint-file",
        default=None,
        metavar="PATH",
        help="prepared claims (default: <plugins-dir>/xpu.kunlun.dev/checkpoint.json)",
    )
    dra.add_argument(
        "--kubeconfig", default=None, metavar="PATH", help="default: in-cluster, else KUBECONFIG"
    )
    labeler = commands.add_parser("labeler", parents=[_common(False), _reading()], help="node labeler")
    labeler.add_argument(
        "--interval", type=_positive, default=300.0, metavar="SECONDS", help="re-check period"
    )
    labeler.add_argument("--once", action="store_true", help="label once and exit")
    labeler.add_argument(
        "--kubeconfig", default=None, metavar="PATH", help="default: in-cluster, else KUBECONFIG"
    )
    labeler.add_argument(
        "--max-backoff-seconds", type=_positive, default=300.0, metavar="SECONDS", help="retry backoff cap"
    )
    exporter = commands.add_parser(
        "exporter", parents=[_common(True), _reading()], help="Prometheus exporter"
    )
    exporter.add_argument("--listen-address", default="0.0.0.0", metavar="ADDR")
    exporter.add_argument("--port", type=int, default=9400, help="HTTP port of /metrics")
    exporter.add_argument(
        "--pod-resources-socket",
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metavar="PATH",
        help="kubelet PodResources socket for pod attribution; '' disables",
    )
    exporter.add_argument(
        "--quarantine-file", default="", metavar="PATH", help="the plugin's quarantine file; '' disables"
    )
    return parser


def _source(args: argparse.Namespace) -> XpuSource:
    kml = args.kml_version_file or None
    return XpuSource(args.xpu_smi, args.dev_root, kml_version_file=kml, timeout_seconds=args.xpu_smi_timeout)


def _reader(args: argparse.Namespace) -> XpuReader:
    """The labeler's or the exporter's source, from `--source`."""
    if args.source == "xpu-smi":
        return _source(args)
    path = args.source.removeprefix(SNAPSHOT_PREFIX)
    if not args.source.startswith(SNAPSHOT_PREFIX) or not path:
        raise ConfigError("--source", f"expected xpu-smi or snapshot:PATH, got {args.source!r}")
    return SnapshotSource(path, args.snapshot_max_age)


def _start_when_ready(start: Callable[[], object], stop: threading.Event) -> bool:
    """Call `start` until the node snapshot it reads is usable; False when stopped first."""
    while True:
        try:
            start()
            return True
        except XpuError as exc:
            logger.warning("waiting for the device plugin's node snapshot (retrying): %s", exc)
        if stop.wait(SNAPSHOT_RETRY_SECONDS):
            return False


def _policy(args: argparse.Namespace) -> HealthPolicy:
    if args.recovery_seconds < 0:
        raise ConfigError("--recovery-seconds", "must be >= 0")
    if args.temperature_warn_celsius > args.temperature_critical_celsius:
        raise ConfigError("--temperature-warn-celsius", "must not exceed --temperature-critical-celsius")
    return HealthPolicy(
        severities=parse_severities(args.health_policy),
        temperature_warn_celsius=args.temperature_warn_celsius,
        temperature_critical_celsius=args.temperature_critical_celsius,
        recovery_seconds=args.recovery_seconds,
    )


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGTERM/SIGINT while the block runs; the previous handlers come back after."""
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _api_client(kubeconfig: str | None, *, retries: bool = True) -> ApiClient:
    """An explicit ApiClient: the library's process-wide default configuration is left untouched.

    ``retries=False`` turns off urllib3's default Retry(3) (with it, one call to an unreachable API
    server takes ~20 s): for callers on a loop that must not stall and retry next round anyway.

    Raises:
        ApiConfigError: no usable configuration, naming what is missing (`--kubeconfig`'s file, or
            both the in-cluster service account and `$KUBECONFIG` / ``~/.kube/config``).
    """
    import yaml
    from kubernetes import client, config

    configuration = client.Configuration()
    unusable = (config.ConfigException, OSError, ValueError, yaml.YAMLError)
    if kubeconfig:
        if not Path(kubeconfig).is_file():
            raise ApiConfigError(f"--kubeconfig {kubeconfig}: no such file")
        try:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except unusable as exc:
            raise ApiConfigError(f"--kubeconfig {kubeconfig}: unusable: {exc}") from exc
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException as in_cluster:
            default = config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION  # $KUBECONFIG, else ~/.kube/config
            try:
                config.load_kube_config(client_configuration=configuration)
            except unusable as exc:
                raise ApiConfigError(
                    f"not running in a cluster ({in_cluster}) and no usable kubeconfig at {default}: {exc}; "
                    "pass --kubeconfig PATH"
                ) from exc
    if not retries:
        configuration.retries = False
    return client.ApiClient(configuration)


def _fault_response(args: argparse.Namespace) -> Callable[[tuple[XpuDevice, ...]], RoundHook] | None:
    """The plugin's fault responder factory, or None without `--respond-to-faults`."""
    if not args.respond_to_faults:
        return None
    from kubernetes import client

    from kunlun_device.faults import FaultResponder, QuarantinePolicy
    from kunlun_device.podresources import PodResourcesClient

    if not args.node_name:
        raise ConfigError("--node-name", "required with --respond-to-faults (or set NODE_NAME)")
    policy = QuarantinePolicy(args.quarantine_failures, args.quarantine_window_seconds)
    api = client.CoreV1Api(_api_client(args.kubeconfig, retries=False))  # on the health thread
    pods = PodResourcesClient(args.pod_resources_socket)
    quarantine_file = Path(args.quarantine_file) if args.quarantine_file else None

    def build(devices: tuple[XpuDevice, ...]) -> RoundHook:
        return FaultResponder(
            devices,
            args.node_name,
            api,
            pods,
            policy,
            taint=args.taint_when_all_unhealthy,
            node_sync_seconds=args.node_sync_seconds,
            quarantine_file=quarantine_file,
            state_file=Path(args.state_file) if args.state_file else None,
        )

    return build


def run_plugin(args: argparse.Namespace) -> int:
    from kunlun_device.plugin import PluginServer

    server = PluginServer(
        _source(args),
        args.kubelet_dir,
        args.socket_name,
        _policy(args),
        args.health_interval,
        fault_response=_fault_response(args),
        snapshot_file=args.snapshot_file or None,
    )
    with _stop_on_signals() as stop:
        server.start()
        stop.wait()
        server.stop()
    return 0


def run_dra(args: argparse.Namespace) -> int:
    from kubernetes import client

    from kunlun_device.dra.kube import KubeClaims
    from kunlun_device.dra.server import DraServer

    if not args.node_name:
        raise ConfigError("--node-name", "required (or set NODE_NAME)")
    api = _api_client(args.kubeconfig, retries=False)  # prepare and the health loop must not stall
    custom = client.CustomObjectsApi(api)
    server = DraServer(
        _source(args),
        args.node_name,
        args.plugins_dir,
        args.registry_dir,
        args.cdi_dir,
        KubeClaims(custom),
        checkpoint_file=args.checkpoint_file,
        policy=_policy(args),
        health_interval_seconds=args.health_interval,
        slices_api=(custom, client.CoreV1Api(api)),
    )
    with _stop_on_signals() as stop:
        server.start()
        stop.wait()
        server.stop()
    return 0


def run_exporter(args: argparse.Namespace) -> int:
    from kunlun_device.exporter import Exporter

    node = args.node_name or socket.gethostname()
    source = _reader(args)
    exporter = Exporter(
        source,
        node,
        _policy(args),
        args.health_interval,
        args.pod_resources_socket or None,
        quarantine_file=Path(args.quarantine_file) if args.quarantine_file else None,
    )
    with _stop_on_signals() as stop:
        if not isinstance(source, SnapshotSource):
            exporter.start()
        elif not _start_when_ready(exporter.start, stop):
            return 0
        exporter.serve(args.listen_address, args.port)
        stop.wait()
        exporter.stop()
    return 0


def run_labeler(args: argparse.Namespace) -> int:
    from kubernetes import client

    from kunlun_device.labeler import NodeLabeler

    if not args.node_name:
        raise ConfigError("--node-name", "required (or set NODE_NAME)")
    labeler = NodeLabeler(client.CoreV1Api(_api_client(args.kubeconfig)), args.node_name, _reader(args))
    if args.once:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            labeler.apply()
        except (ApiException, HTTPError) as exc:
            logger.error("labelling node %s failed: %s", args.node_name, exc)
            return 1
        return 0
    with _stop_on_signals() as stop:
        labeler.run(stop, args.interval, args.max_backoff_seconds)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runners = {"plugin": run_plugin, "dra": run_dra, "labeler": run_labeler, "exporter": run_exporter}
    try:
        return runners[args.command](args)
    except ConfigError as exc:
        print(f"kunlun-device-plugin {args.command}: {exc}", file=sys.stderr)
        return 2
    except XpuError as exc:
        logger.error("%s: %s", args.command, exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
