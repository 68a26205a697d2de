"""Console entry point ``kunlun-operator``: ``run [flags]`` and ``render -f FILE`` (docs/operator.md).

Owns: flag parsing, logging setup, wiring the API client, controller, metrics server, webhook
server and kopf registry together, and handing control to kopf; for ``render``, reading the
``run`` flags of its ``--config`` with the same parser, so the dry run is configured as the operator.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import kopf

from kunlun_operator import names
from kunlun_operator.policy.admission_policy import STRICTEST, AdmissionPolicy, parse_policy
from kunlun_operator.shell import render as render_module
from kunlun_operator.shell.controller import Controller, ControllerConfig
from kunlun_operator.shell.handlers import LoopConfig, build_registry, post_event
from kunlun_operator.shell.kube import KubeClient, load_config
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.spec import operator_config
from kunlun_operator.spec.operator_config import PickerImages, PreflightHost

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kunlun-operator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_flags(sub.add_parser("run", help="reconcile KunlunInferenceServices until stopped"))
    render_module.add_render_flags(
        sub.add_parser(
            "render",
            help="print the objects the operator would create for a KunlunInferenceService (no API server)",
            description=render_module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return parser


def add_run_flags(run: argparse.ArgumentParser) -> None:
    """The flags of ``run``: also what ``render --config`` reads."""
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], help="a namespace to serve (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="serve every namespace (the default)")
    run.add_argument("--peering", default="kunlun-operator", help="kopf cluster-wide peering name (HA)")
    run.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    run.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest live replica reconciles (default: random, so exactly one does)",
    )
    run.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        help="seconds a silent peer counts as alive (failover time)",
    )
    run.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="liveness endpoint URL")
    run.add_argument("--metrics-port", type=int, default=8080, help="port of /metrics (0: off)")
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--compatibility-configmap",
        default=None,
        metavar="NAMESPACE/NAME",
        help="the compatibility-matrix ConfigMap (default: the matrix in the package)",
    )
    run.add_argument(
        "--default-runtime-image",
        default=names.DEFAULT_RUNTIME_IMAGE,
        help="runtime image of services without spec.runtime.image, used only when no compatibility-matrix "
        "entry certifying their versions names an image",
    )
    run.add_argument(
        "--admission-policy",
        default=None,
        metavar="FILE",
        help="the admission policy YAML (allowed images, host paths, overrides); default: allow nothing extra",
    )
    run.add_argument("--webhook-port", type=int, default=9443, help="admission webhook port (0: no webhook)")
    run.add_argument("--webhook-host", default=None, help="host name the webhook server reports (optional)")
    run.add_argument(
        "--webhook-cert-dir",
        default=None,
        help="directory with tls.crt and tls.key; without it the webhook speaks plain HTTP",
    )
    run.add_argument(
        "--image-volumes", action="store_true", help="mount image model sources as image volumes"
    )
    run.add_argument(
        "--xpu-health-gate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="runtime pods get a readiness gate on the node agent's kunlun.dev/xpu-healthy condition; "
        "turn off where no node agent runs (else each new pod waits --xpu-health-gate-grace-seconds "
        "before the operator sets the condition itself)",
    )
    run.add_argument(
        "--xpu-health-gate-grace-seconds",
        type=_non_negative_seconds,
        default=120.0,
        metavar="S",
        help="a runtime pod whose containers are ready but whose kunlun.dev/xpu-healthy condition no device "
        "plugin set for S seconds gets it True from the operator (reason NoHealthReporter, with Warning "
        "events), so a missing or denied device plugin cannot stall a rollout; 0: never",
    )
    run.add_argument(
        "--leaderworkerset",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve multi-node services (spec.runtime.pipelineParallelSize > 1) as LeaderWorkerSets where "
        "the cluster serves leaderworkerset.x-k8s.io/v1 (discovery); --no-leaderworkerset: never (the "
        "operator has no rights on them), such services are rejected",
    )
    run.add_argument(
        "--inference-pool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route services with spec.routing.type InferencePool through an InferencePool and its Endpoint "
        f"Picker where the cluster serves {names.INFERENCE_GROUP_VERSION} (discovery; an HTTPRoute where it "
        f"serves {names.GATEWAY_GROUP_VERSION}); --no-inference-pool: never (the operator has no rights on "
        "them), such services are rejected",
    )
    run.add_argument(
        "--dra",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve services with spec.resources.allocation dra: their pods claim their cards through a "
        f"ResourceClaimTemplate of DeviceClass {names.DRA_DRIVER} (Dynamic Resource Allocation) where the "
        f"cluster serves {names.DRA_GROUP_VERSION} (discovery); off (the default, until the nodes run the DRA "
        "kubelet plugin): such services are rejected naming spec.resources.allocation, and the operator "
        "makes no call on that API",
    )
    run.add_argument(
        "--endpoint-picker-image",
        default=names.DEFAULT_ENDPOINT_PICKER_IMAGE,
        metavar="IMAGE",
        help="the Endpoint Picker of routed services that name none (the Gateway API Inference Extension's)",
    )
    run.add_argument(
        "--precise-endpoint-picker-image",
        default=names.DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE,
        metavar="IMAGE",
        help="the Endpoint Picker of services with spec.routing.precise that name none (llm-d's, which "
        "indexes the pods' KV events)",
    )
    run.add_argument(
        "--precise-tokenizer-image",
        default=names.DEFAULT_PRECISE_TOKENIZER_IMAGE,
        metavar="IMAGE",
        help="the tokenizer sidecar of the picker of services with spec.routing.precise (llm-d's UDS "
        "tokenizer; it reads the model's tokenizer files, offline)",
    )
    run.add_argument(
        "--preflight-kml-version-file",
        default=names.HOST_KML_VERSION_FILE,
        metavar="HOST_PATH",
        help="host path of the node's KML version file; its directory is mounted read-only into the Strict "
        "preflight (a node without the file fails the preflight, naming it); "
        "empty: no hostPath (for namespaces enforcing Pod Security baseline/restricted), preflight reads "
        "the image's own KML version file",
    )
    run.add_argument(
        "--preflight-xpu-smi",
        default="",
        metavar="HOST_PATH",
        help="host path of the node agent's xpu-smi, mounted read-only into the Strict preflight "
        "(default: the runtime image's own)",
    )
    run.add_argument(
        "--resync-seconds", type=float, default=300.0, help="periodic reconcile of every service"
    )
    run.add_argument("--retry-delay", type=float, default=2.0, help="first retry delay; doubles up to 60 s")
    run.add_argument(
        "--watch-timeout", type=float, default=300.0, help="server-side timeout of watch requests"
    )


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _webhook(args: argparse.Namespace) -> kopf.WebhookServer | None:
    if not args.webhook_port:
        return None
    if args.webhook_cert_dir is None:
        return kopf.WebhookServer(
            addr="0.0.0.0", port=args.webhook_port, host=args.webhook_host, insecure=True
        )
    cert_dir = Path(args.webhook_cert_dir)
    return kopf.WebhookServer(
        addr="0.0.0.0",
        port=args.webhook_port,
        host=args.webhook_host,
        certfile=str(cert_dir / "tls.crt"),
        pkeyfile=str(cert_dir / "tls.key"),
    )


def _matrix_configmap(value: str | None) -> tuple[str, str] | None:
    if value is None:
        return None
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name:
        raise SystemExit(f"kunlun-operator: --compatibility-configmap must be NAMESPACE/NAME, got {value!r}")
    return namespace, name


def _admission_policy(path: str | None) -> AdmissionPolicy:
    """The policy in ``path``; the empty (strictest) policy without one. A broken file stops the
    operator: running with a looser policy than the admin wrote is worse than not running."""
    if path is None:
        return STRICTEST
    try:
        return parse_policy(Path(path).read_text(), source=path)
    except (OSError, ValueError) as error:
        raise SystemExit(f"kunlun-operator: --admission-policy: {error}") from None


def parse_preflight_host(args: argparse.Namespace) -> PreflightHost:
    """The node files the preflight mounts (``operator_config.parse_preflight_host``); a bad path
    stops the operator, naming the flag."""
    try:
        return operator_config.parse_preflight_host(args.preflight_kml_version_file, args.preflight_xpu_smi)
    except ValueError as error:
        raise SystemExit(f"kunlun-operator: {error}") from None


def controller_config(args: argparse.Namespace) -> ControllerConfig:
    """What the ``run`` flags ``args`` configure of the reconcile; a bad flag value stops here."""
    return ControllerConfig(
        default_image=args.default_runtime_image,
        matrix_configmap=_matrix_configmap(args.compatibility_configmap),
        image_volumes=args.image_volumes,
        xpu_health_gate=args.xpu_health_gate,
        policy=_admission_policy(args.admission_policy),
        preflight_host=parse_preflight_host(args),
        leaderworkerset=args.leaderworkerset,
        health_gate_grace_seconds=args.xpu_health_gate_grace_seconds,
        inference_pool=args.inference_pool,
        dra=args.dra,
        picker_images=PickerImages(
            args.endpoint_picker_image, args.precise_endpoint_picker_image, args.precise_tokenizer_image
        ),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format=LOG_FORMAT, stream=sys.stdout)
    # kopf logs every successful event handler at INFO; our decisions are logged by our modules.
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # liveness probes
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    controller = Controller(
        KubeClient(load_config()),
        controller_config(args),
        metrics,
        post_event,
    )
    registry = build_registry(
        controller,
        LoopConfig(
            resync_seconds=args.resync_seconds,
            retry_delay_seconds=args.retry_delay,
            watch_timeout_seconds=args.watch_timeout,
            peering_lifetime_seconds=args.peering_lifetime,
            webhook=_webhook(args),
        ),
    )
    # kopf pauses *every* replica when live peers share a priority: a random one per process makes
    # the highest-priority replica the single active one, and the next one take over when it dies.
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    kopf.run(
        registry=registry,
        standalone=args.standalone or None,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


def render(args: argparse.Namespace) -> int:
    """``kunlun-operator render``: the operator's flags from ``--config`` (parsed as ``run`` parses
    them), then the dry run."""
    try:
        flags = render_module.read_flags_file(args.config) if args.config else []
    except render_module.RenderError as error:
        print(f"{render_module.PROG}: {error}", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(
        prog=f"{render_module.PROG} --config {args.config}",
        usage="%(prog)s: [the flags of kunlun-operator run]",
        add_help=False,
    )
    add_run_flags(parser)
    operator = parser.parse_args(flags)
    try:
        config = controller_config(operator)
    except SystemExit as error:  # run's own message for a bad value; say it came from the flags file
        reason = str(error.code).removeprefix("kunlun-operator: ")
        print(f"{render_module.PROG} --config {args.config}: {reason}", file=sys.stderr)
        return 1
    return render_module.render_command(args, config, admission_webhook=operator.webhook_port != 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return render(args) if args.command == "render" else run(args)


if __name__ == "__main__":
    sys.exit(main())
