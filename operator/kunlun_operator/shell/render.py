"""``kunlun-operator render``: the dry run's files and printing, around ``decide.render``.

Owns: reading the custom resources (``-f``) and the operator's flags file (``--config``), the facts
of a fresh cluster (no nodes, no objects, only the API groups named by ``--api-versions``), and
printing the objects as multi-document YAML (apply order, keys in the order the builders give
them). Decides nothing itself: the verdict and the objects are the webhook's and the reconcile's.
Must not talk to the API. Invariant: stdout carries objects only when every service rendered; each
error goes to stderr, naming the file, the service and the field.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from kunlun_operator import names
from kunlun_operator.decide.reconcile import ClusterFacts
from kunlun_operator.decide.render import Rendering, render_service
from kunlun_operator.policy.matrix import load_default_matrix, merge_cards, parse_matrix
from kunlun_operator.shell.controller import ControllerConfig

PROG = "kunlun-operator render"
#: The API groups besides the built-in ones whose presence changes what the operator builds.
OPTIONAL_API_VERSIONS = (
    names.LWS_GROUP_VERSION,
    names.MONITORING_GROUP_VERSION,
    names.INFERENCE_GROUP_VERSION,
    names.GATEWAY_GROUP_VERSION,
    names.DRA_GROUP_VERSION,
)
DESCRIPTION = """\
Print, as YAML documents, exactly the objects the operator creates for each KunlunInferenceService
in FILE (the same admission check and reconcile as `run`), or the admission error naming the field
(on stderr, exit 1). No API server is read: the cluster is assumed fresh, i.e. no Kunlun node
labelled yet, none of the service's objects there, the packaged compatibility matrix (as when the
--compatibility-configmap ConfigMap is absent) unless --compatibility-matrix gives one, and only
the built-in API groups served unless --api-versions names more (LeaderWorkerSet for multi-node
services, the Prometheus Operator for ServiceMonitor and PrometheusRule, the Gateway API Inference
Extension's InferencePool and Gateway API's HTTPRoute for routed services, resource.k8s.io/v1 for
services with allocation dra, which also need --dra among the flags). The operator is
configured by --config: a YAML list of its `run` flags (the args of its container)."""


class RenderError(Exception):
    """A file cannot be read as render needs it; the message names the file and what is wrong."""


@dataclass(frozen=True, slots=True)
class FreshCluster:
    """What render assumes of the cluster: a fresh one serving the built-in kinds and
    ``api_versions``; ``matrix_text``: the compatibility ConfigMap's ``matrix.yaml``, None: absent."""

    api_versions: frozenset[str] = frozenset()
    matrix_text: str | None = None
    matrix_source: str = ""


def add_render_flags(render: argparse.ArgumentParser) -> None:
    """The flags of ``render`` (``--config`` is read by ``cli``, with ``run``'s own parser)."""
    render.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="the KunlunInferenceService(s); - for stdin"
    )
    render.add_argument(
        "--config",
        metavar="FILE",
        help="the operator's run flags as a YAML list of strings, e.g. the args of the operator's "
        "container (a leading 'run' is skipped); default: run's defaults",
    )
    render.add_argument(
        "-a",
        "--api-versions",
        action="append",
        default=[],
        metavar="GROUP/VERSION",
        choices=OPTIONAL_API_VERSIONS,
        help="an API group version the cluster serves besides the built-in ones (repeatable): "
        f"{names.LWS_GROUP_VERSION} (LeaderWorkerSet), {names.MONITORING_GROUP_VERSION} (Prometheus Operator), "
        f"{names.INFERENCE_GROUP_VERSION} (InferencePool), {names.GATEWAY_GROUP_VERSION} (HTTPRoute), "
        f"{names.DRA_GROUP_VERSION} (Dynamic Resource Allocation)",
    )
    render.add_argument(
        "-n", "--namespace", default=None, help="the namespace of services that name none (default: default)"
    )
    render.add_argument(
        "--compatibility-matrix",
        default=None,
        metavar="FILE",
        help="the matrix.yaml of the --compatibility-configmap ConfigMap (default: the packaged matrix, as "
        "when that ConfigMap is absent)",
    )


def render_command(
    args: argparse.Namespace,
    config: ControllerConfig,
    *,
    admission_webhook: bool,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``render`` with its flags ``args`` for an operator configured as ``config``: 0, or 1 after
    saying on ``err`` (default: stderr) what is wrong."""
    err = err or sys.stderr
    matrix_text = None
    try:
        if args.compatibility_matrix is not None:
            matrix_text = _read_text(args.compatibility_matrix)
        elif config.matrix_configmap is not None:
            print(
                f"{PROG}: note: ConfigMap {'/'.join(config.matrix_configmap)} is not read (no API server): "
                "the packaged matrix is used, as when it is absent; give its matrix.yaml with "
                "--compatibility-matrix",
                file=err,
            )
        cluster = FreshCluster(frozenset(args.api_versions), matrix_text, args.compatibility_matrix or "")
        facts = fresh_cluster_facts(config, cluster)
    except RenderError as error:
        print(f"{PROG}: {error}", file=err)
        return 1
    return render(
        args.filename, facts, admission_webhook=admission_webhook, namespace=args.namespace, out=out, err=err
    )


def read_flags_file(path: str) -> list[str]:
    """The operator's ``run`` flags in ``path``: a YAML list of strings, as the ``args`` of the
    operator's container (a leading ``run`` is skipped), so the chart's rendering can be copied.

    Raises:
        RenderError: the file is unreadable or not such a list.
    """
    data = _load_yaml(path, all_documents=False)
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        raise RenderError(
            f"{path}: --config must be a YAML list of the operator's run flags (its container's args), "
            f"e.g. ['--default-runtime-image=REPO/kunlun-runtime:TAG', '--admission-policy=policy.yaml']"
        )
    return data[1:] if data[:1] == ["run"] else data


def read_services(path: str, namespace: str | None) -> list[dict[str, Any]]:
    """The KunlunInferenceServices in ``path`` (``-`` for stdin), each in its namespace: its own,
    else ``namespace``, else ``default`` (as kubectl's default context would).

    Raises:
        RenderError: unreadable YAML, no service at all, a document that is no
            KunlunInferenceService or has no ``metadata.name``, or a namespace other than ``namespace``.
    """
    services = []
    for index, doc in enumerate(_load_yaml(path, all_documents=True)):
        where = f"{path}: document {index + 1}"
        if doc is None:
            continue
        if not isinstance(doc, Mapping) or (doc.get("apiVersion"), doc.get("kind")) != (
            names.API_VERSION,
            names.KIND,
        ):
            kind = (
                (doc.get("apiVersion"), doc.get("kind")) if isinstance(doc, Mapping) else type(doc).__name__
            )
            raise RenderError(
                f"{where}: apiVersion, kind: want {names.API_VERSION}, {names.KIND}; got {kind}"
            )
        meta = dict(doc.get("metadata") or {})
        if not isinstance(meta.get("name"), str) or not meta["name"]:
            raise RenderError(f"{where}: metadata.name: is required")
        own = meta.get("namespace")
        if own and namespace and own != namespace:
            raise RenderError(
                f"{where}: metadata.namespace: {own!r} does not match --namespace {namespace!r}"
            )
        meta["namespace"] = own or namespace or "default"
        services.append({**doc, "metadata": meta})
    if not services:
        raise RenderError(f"{path}: no {names.KIND} in it")
    return services


def fresh_cluster_facts(config: ControllerConfig, cluster: FreshCluster) -> ClusterFacts:
    """The facts a new service meets on a cluster with no Kunlun nodes labelled, configured as
    ``config`` (the operator's flags) says, serving ``cluster.api_versions``.

    Raises:
        RenderError: the matrix does not parse.
    """
    matrix = load_default_matrix().under_registry_of(config.default_image)
    if cluster.matrix_text is not None:
        try:
            matrix = merge_cards(parse_matrix(cluster.matrix_text, source=cluster.matrix_source), matrix)
        except ValueError as error:
            raise RenderError(str(error)) from None
    monitoring = names.MONITORING_GROUP_VERSION in cluster.api_versions
    pools = config.inference_pool and names.INFERENCE_GROUP_VERSION in cluster.api_versions
    return ClusterFacts(
        nodes=(),
        matrix=matrix,
        default_image=config.default_image,
        monitoring_plurals=frozenset(k.plural for k in names.MONITORING_KINDS) if monitoring else frozenset(),
        leaderworkerset_served=config.leaderworkerset and names.LWS_GROUP_VERSION in cluster.api_versions,
        image_volumes=config.image_volumes,
        xpu_health_gate=config.xpu_health_gate,
        policy=config.policy,
        preflight_host=config.preflight_host,
        inference_pool_served=pools,
        httproute_served=pools and names.GATEWAY_GROUP_VERSION in cluster.api_versions,
        picker_images=config.picker_images,
        dra_served=config.dra and names.DRA_GROUP_VERSION in cluster.api_versions,
    )


def render(
    path: str,
    facts: ClusterFacts,
    *,
    admission_webhook: bool,
    namespace: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print the objects of every service in ``path`` to ``out``; 0, or 1 after printing each
    denial or failure (and no objects) to ``err``. Admission warnings go to ``err`` either way.
    ``out``, ``err``: stdout and stderr by default."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        services = read_services(path, namespace)
    except RenderError as error:
        print(f"{PROG}: {error}", file=err)
        return 1
    objects: list[dict[str, Any]] = []
    failed = False
    for body in services:
        meta = body["metadata"]
        who = f"{path}: {names.KIND} {meta['namespace']}/{meta['name']}"
        rendering: Rendering = render_service(body, facts, admission_webhook=admission_webhook)
        for warning in rendering.warnings:
            print(f"{PROG}: warning: {who}: {warning}", file=err)
        if rendering.error is not None:
            print(f"{PROG}: {who} is refused ({rendering.reason}): {rendering.error}", file=err)
            failed = True
        objects += rendering.objects
    if failed:
        return 1
    out.write(dump_objects(objects))
    return 0


def dump_objects(objects: Iterable[Mapping[str, Any]]) -> str:
    """``objects`` as YAML documents, each opened by ``---``: keys in the builders' order, no
    anchors for shared sub-objects, multi-line strings (the runtime's config file) as blocks."""
    return yaml.dump_all(
        [dict(o) for o in objects], Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100
    )


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def _read_text(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as error:
        raise RenderError(f"{path}: {error.strerror or error}") from None


def _load_yaml(path: str, *, all_documents: bool) -> Any:
    text = _read_text(path)
    try:
        return list(yaml.safe_load_all(text)) if all_documents else yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RenderError(f"{path}: not YAML: {error}") from None
