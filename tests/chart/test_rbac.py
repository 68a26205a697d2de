"""The chart's ClusterRoles grant exactly the API calls the operator and the labeler make.

Sources of the calls, best first: the operator's machine-readable `kunlun_operator/api_calls.yaml`
(kept complete by the operator's integration test, which records the fake API server's request
log), and the API-call table in docs/device-plugin.md that the labeler documents as its RBAC
contract. A missing source is a failure: the chart's rights would be unchecked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.chart.tools import REPO, Rendered, render

Grant = tuple[str, str, str]  # (api group, resource, verb)
OPERATOR_API_CALLS = REPO / "operator" / "kunlun_operator" / "api_calls.yaml"
DEVICE_DOC = REPO / "docs" / "device-plugin.md"


def grants_of_rules(rules: list[dict]) -> set[Grant]:
    """Every (group, resource, verb) a list of PolicyRules grants; wildcards are refused."""
    out = set()
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], f"wildcard in {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _names(cell: str) -> list[str]:
    """`serving.kunlun.dev` / `""` / `services`, `configmaps` / get, list → bare names."""
    found = re.findall(r"`([^`]*)`", cell)
    names = found if found else [w.strip() for w in cell.split(",")]
    return ["" if n in {'""', "core"} else n for n in names]


def table_after(text: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table after the heading that contains `heading`, as row dicts."""
    section = text[text.index(heading) :]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    start = section.splitlines().index(lines[0])
    block = []
    for ln in section.splitlines()[start:]:
        if not ln.startswith("|"):
            break
        block.append(ln)
    header = [c.lower() for c in _cells(block[0])]
    return [dict(zip(header, _cells(ln), strict=True)) for ln in block[2:]]


def operator_calls(
    *, leaderworkerset: bool = False, routing: bool = False, dra: bool = False, lora: bool = False
) -> set[Grant]:
    """The operator's calls; those on LeaderWorkerSet (rules marked `leaderworkerset`) only when
    ``leaderworkerset`` (the chart's leaderWorkerSet.installed), those of routed services (rules
    marked `routing`, with the rights it holds to grant its pickers) only when ``routing`` (the
    chart's routing.enabled), those of services claiming cards through DRA (rules marked `dra`) only
    when ``dra`` (a device-plugin node pool with allocation dra or both), the API-key Secrets of
    LoRA run-time updates (rules marked `lora`) only when ``lora`` (operator.rbac.apiKeySecrets)."""
    assert OPERATOR_API_CALLS.is_file(), f"{OPERATOR_API_CALLS} is missing: no record of the operator's calls"
    rules = yaml.safe_load(OPERATOR_API_CALLS.read_text())
    return calls_from_api_calls_yaml(
        [
            r
            for r in rules
            if (leaderworkerset or not r.get("leaderworkerset"))
            and (routing or not r.get("routing"))
            and (dra or not r.get("dra"))
            and (lora or not r.get("lora"))
        ]
    )


def calls_from_api_calls_yaml(data: object) -> set[Grant]:
    """Accept the operator's record: a list (or `calls:` list) of entries with a group, one or more
    resources and verbs, under the usual spellings."""
    entries = data.get("calls", data.get("rules", data)) if isinstance(data, dict) else data
    assert isinstance(entries, list), f"{OPERATOR_API_CALLS}: expected a list of calls"
    out = set()
    for e in entries:
        groups = e.get("apiGroups", [e.get("apiGroup", e.get("group", ""))])
        resources = e.get("resources", [e.get("resource")])
        verbs = e.get("verbs", [e.get("verb")])
        out |= {("" if g in {None, "core"} else g, r, v) for g in groups for r in resources for v in verbs}
    return out


def labeler_calls() -> set[Grant]:
    assert DEVICE_DOC.is_file(), f"{DEVICE_DOC} is missing: no record of the labeler's calls"
    rows = table_after(DEVICE_DOC.read_text(), "Kubernetes API calls")
    # The labeler talks to the core API only (/api/v1/nodes/...): group "".
    assert all(row["call"].split("`")[1].split()[1].startswith("/api/v1/") for row in rows)
    return {("", r, v) for row in rows for r in _names(row["resource"]) for v in _names(row["verb"])}


def test_operator_cluster_role_is_exactly_its_api_calls(default_render: Rendered) -> None:
    role = default_render.one("ClusterRole", "-operator")
    granted, needed = grants_of_rules(role["rules"]), operator_calls()
    assert needed - granted == set(), "calls the operator makes that the chart does not grant"
    assert granted - needed == set(), "grants nobody needs (least privilege)"


def test_leaderworkerset_rights_only_where_it_is_stated_installed() -> None:
    """leaderWorkerSet.installed=true grants exactly the LeaderWorkerSet calls and leaves the
    operator's --leaderworkerset on; by default the operator runs with --no-leaderworkerset."""
    from kunlun_operator.shell import cli as operator_cli

    lws_calls = operator_calls(leaderworkerset=True) - operator_calls()
    assert lws_calls == {
        ("leaderworkerset.x-k8s.io", "leaderworkersets", v)
        for v in ("get", "list", "watch", "create", "patch", "delete")
    }
    for installed in (False, True):
        rendered = render(overrides={"leaderWorkerSet": {"installed": installed}})
        role = rendered.one("ClusterRole", "-operator")
        assert grants_of_rules(role["rules"]) == operator_calls(leaderworkerset=installed)
        container = rendered.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
        assert operator_cli.build_parser().parse_args(container["args"]).leaderworkerset is installed


def test_namespaced_operator_peers_through_kopfpeerings_instead(rendered_sets: dict[str, Rendered]) -> None:
    """With operator.watchNamespaces kopf runs namespaced and uses KopfPeering objects (kopf's
    `guess_selectors`), so the cluster-wide peering grant is swapped for the namespaced one."""
    role = rendered_sets["ha-values"].one("ClusterRole", "-operator")
    peering = {(g, r, v) for g, r, v in operator_calls() if r == "clusterkopfpeerings"}
    expected = (operator_calls() - peering) | {("kopf.dev", "kopfpeerings", v) for _, _, v in peering}
    assert grants_of_rules(role["rules"]) == expected


def fault_response_calls() -> set[Grant]:
    """The plugin's fault response (pod conditions, Events, quarantine annotation, taint): its own
    table in docs/device-plugin.md, core API only."""
    rows = table_after(DEVICE_DOC.read_text(), "Fault response API calls")
    assert all(row["call"].split("`")[1].split()[1].startswith("/api/v1/") for row in rows)
    return {("", r, v) for row in rows for r in _names(row["resource"]) for v in _names(row["verb"])}


def test_device_plugin_cluster_role_is_exactly_its_api_calls(default_render: Rendered) -> None:
    role = default_render.one("ClusterRole", "-device-plugin")
    assert fault_response_calls() == {
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("", "pods/status", "patch"),
        ("", "events", "create"),
    }
    assert grants_of_rules(role["rules"]) == labeler_calls() | fault_response_calls()


def test_without_fault_response_the_device_plugin_keeps_only_the_labelers_rights() -> None:
    off = render(overrides={"devicePlugin": {"faults": {"enabled": False}}})
    assert grants_of_rules(off.one("ClusterRole", "-device-plugin")["rules"]) == labeler_calls()
    spec = off.one("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]
    assert "fault-state" not in {v["name"] for v in spec["volumes"]}
    assert not [a for c in spec["containers"] for a in c["args"] if "fault" in a or "quarantine" in a]


def test_roles_are_bound_to_the_service_accounts_the_pods_run_as(default_render: Rendered) -> None:
    for suffix, workload in (("-operator", "Deployment"), ("-device-plugin", "DaemonSet")):
        binding = default_render.one("ClusterRoleBinding", suffix)
        pod_sa = default_render.one(workload, suffix)["spec"]["template"]["spec"]["serviceAccountName"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": default_render.one("ClusterRole", suffix)["metadata"]["name"],
        }
        subject = {"kind": "ServiceAccount", "name": pod_sa, "namespace": "kunlun-system"}
        assert binding["subjects"] == [subject]
        default_render.one("ServiceAccount", suffix)


def test_doc_table_parser_reads_groups_resources_and_verbs(tmp_path: Path) -> None:
    text = (
        "## Kubernetes API calls\n\n| API group | resource | verbs | why |\n| --- | --- | --- | --- |\n"
        '| `""` | `services`, `configmaps` | get, patch | x |\n| `apps` | `deployments` | list | y |\n'
    )
    rows = table_after(text, "Kubernetes API calls")
    got = {
        (g, r, v)
        for row in rows
        for g in _names(row["api group"])
        for r in _names(row["resource"])
        for v in _names(row["verbs"])
    }
    assert got == {
        ("", "services", "get"),
        ("", "services", "patch"),
        ("", "configmaps", "get"),
        ("", "configmaps", "patch"),
        ("apps", "deployments", "list"),
    }


def test_rbac_table_in_docs_chart_md_lists_the_rendered_operator_rules(default_render: Rendered) -> None:
    doc = (REPO / "docs" / "chart.md").read_text()

    def documented(heading: str) -> set[Grant]:
        return {
            (g, r, v)
            for row in table_after(doc, heading)
            for g in _names(row["api group"])
            for r in _names(row["resource"])
            for v in _names(row["verbs"])
        }

    assert documented("Operator ClusterRole") == grants_of_rules(
        default_render.one("ClusterRole", "-operator")["rules"]
    )
    installed = render(overrides={"leaderWorkerSet": {"installed": True}}).one("ClusterRole", "-operator")
    assert documented("With leaderWorkerSet.installed") == (
        grants_of_rules(installed["rules"])
        - grants_of_rules(default_render.one("ClusterRole", "-operator")["rules"])
    )


def dra_plugin_calls() -> set[Grant]:
    """The DRA kubelet plugin's calls: its own table in docs/device-plugin.md."""
    rows = table_after(DEVICE_DOC.read_text(), "DRA API calls")
    out = set()
    for row in rows:
        path = row["call"].split("`")[1].split()[1]
        group = "" if path.startswith("/api/v1/") else path.split("/")[2]
        out |= {(group, r, v) for r in _names(row["resource"]) for v in _names(row["verb"])}
    return out


@pytest.mark.parametrize("allocation", ["devicePlugin", "dra", "both"])
def test_dra_rights_and_the_operators_dra_flag_only_where_a_pool_uses_dra(allocation: str) -> None:
    from kunlun_operator.shell import cli as operator_cli

    rendered = render(overrides={"devicePlugin": {"nodePools": {"pool-a": allocation}}})
    dra = allocation != "devicePlugin"
    assert grants_of_rules(rendered.one("ClusterRole", "-operator")["rules"]) == operator_calls(dra=dra)
    plugin = labeler_calls() | fault_response_calls() | (dra_plugin_calls() if dra else set())
    assert grants_of_rules(rendered.one("ClusterRole", "-device-plugin")["rules"]) == plugin
    container = rendered.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert operator_cli.build_parser().parse_args(container["args"]).dra is dra
    assert dra_plugin_calls() == {
        ("", "nodes", "get"),
        ("resource.k8s.io", "resourceslices", "get"),
        ("resource.k8s.io", "resourceslices", "create"),
        ("resource.k8s.io", "resourceslices", "patch"),
        ("resource.k8s.io", "resourceclaims", "get"),
    }


API_KEY_CALLS = {("", "secrets", "get")}


def api_key_grants(rendered: Rendered) -> dict[str | None, set[Grant]]:
    """The grants of the ``-operator-api-keys`` roles by namespace (None: the ClusterRole), each
    checked to be bound to the operator's ServiceAccount."""
    out: dict[str | None, set[Grant]] = {}
    sa = rendered.one("Deployment", "-operator")["spec"]["template"]["spec"]["serviceAccountName"]
    for kind in ("ClusterRole", "Role"):
        for role in rendered.all(kind):
            if not role["metadata"]["name"].endswith("-operator-api-keys"):
                continue
            namespace = role["metadata"].get("namespace")
            bindings = [
                b
                for b in rendered.all(f"{kind}Binding")
                if b["metadata"]["name"] == role["metadata"]["name"]
                and b["metadata"].get("namespace") == namespace
            ]
            assert [(b["roleRef"], b["subjects"]) for b in bindings] == [
                (
                    {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role["metadata"]["name"]},
                    [{"kind": "ServiceAccount", "name": sa, "namespace": "kunlun-system"}],
                )
            ]
            out[namespace] = grants_of_rules(role["rules"])
    return out


@pytest.mark.parametrize("watch", [[], ["ml", "chat"]])
def test_api_key_secrets_get_only_with_the_value_and_only_in_the_watched_namespaces(watch: list[str]) -> None:
    """operator.rbac.apiKeySecrets grants exactly the `lora` calls (get secrets, never list or
    watch): a Role in each watched namespace, a ClusterRole when the operator watches them all; off
    by default, when the operator's ClusterRole holds no right on Secrets either."""
    assert operator_calls(lora=True) - operator_calls() == API_KEY_CALLS
    operator = {"watchNamespaces": watch}

    def calls(*, lora: bool) -> set[Grant]:  # namespaced: kopf's KopfPeerings instead
        peering = "kopfpeerings" if watch else "clusterkopfpeerings"
        return {(g, peering if r == "clusterkopfpeerings" else r, v) for g, r, v in operator_calls(lora=lora)}

    off = render(overrides={"operator": operator})
    assert api_key_grants(off) == {}
    assert grants_of_rules(off.one("ClusterRole", "-operator")["rules"]) == calls(lora=False)
    on = render(overrides={"operator": {**operator, "rbac": {"apiKeySecrets": True}}})
    expected: dict[str | None, set[Grant]] = (
        {ns: API_KEY_CALLS for ns in watch} if watch else {None: API_KEY_CALLS}
    )
    assert api_key_grants(on) == expected
    main = grants_of_rules(on.one("ClusterRole", "-operator")["rules"])
    assert main == calls(lora=False) and main | API_KEY_CALLS == calls(lora=True)
