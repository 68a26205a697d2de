"""``kunlun-runtime preflight``: re-check the node's real Kunlun versions and cards before loading.

The operator's init container runs it under the ``Strict`` version policy with
``--expect-driver V --expect-firmware V --expect-kml V``. It reads the cards and versions through
``kunlun_device.xpu`` (never parsing tool output here), checks the cards this container may use
(``XPU_VISIBLE_DEVICES``, else all listed) with the device plugin's health checks, and compares
each version exactly (the node labels the pods were scheduled by hold the same strings).

In the operator's pod the cards are the ones kubelet allocated to the init container
(``--require-allocation``: no ``XPU_VISIBLE_DEVICES`` is a failure), the KML version file is the
node's, mounted read-only (``--kml-version-file``), and ``xpu-smi`` is the image's or the node's
(``--xpu-smi``). A version that is expected but cannot be read fails with what was missing: the
``xpu-smi`` command, the KML version file's path, the card's device node, or the allocation.

Exit status 0 when everything matches, 1 otherwise with one line naming every problem on stderr;
``--json`` also prints the whole finding on stdout. Invariant: ``ok`` is true only when no
problem was found; an unreadable tool or file is a problem, never a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from kunlun_device.errors import XpuError, XpuToolMissingError
from kunlun_device.xpu import DEFAULT_KML_VERSION_FILE, XpuDevice, XpuSource
from kunlun_device.xpu.health import HealthPolicy, Severity, evaluate
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.flags import Command
from kunlun_runtime.platforms.kunlun import (
    DEV_ROOT_ENV,
    KML_VERSION_FILE_ENV,
    VISIBLE_DEVICES_ENV,
    XPU_SMI_ENV,
    visible_card_indices,
)

COMPONENTS = ("driver", "firmware", "kml")


@dataclass(frozen=True, slots=True)
class CardReport:
    index: int
    uuid: str
    product: str
    memory_total_bytes: int
    firmware_version: str | None
    healthy: bool
    findings: tuple[dict[str, str], ...]  # check, severity, detail (warn-only findings included)


@dataclass(frozen=True, slots=True)
class PreflightReport:
    ok: bool
    reason: str | None  # all problems, "; "-joined; None when ok
    xpu_smi: str
    dev_root: str
    visible_devices: tuple[int, ...] | None
    expected: dict[str, str | None]
    found: dict[str, str | None]  # driver, runtime (XPU-RT), firmware, kml
    cards: tuple[CardReport, ...]

    def to_dict(self) -> dict:
        return asdict(self)


def _card_reports(
    source: XpuSource, cards: tuple[XpuDevice, ...]
) -> tuple[tuple[CardReport, ...], list[str]]:
    """Health of each card (the device plugin's checks and default policy) and its problems."""
    try:
        table, tool_error = source.telemetry(), None
    except XpuError as error:
        table, tool_error = None, str(error)
    findings = evaluate(cards, table, tool_error, source.device_node_present, HealthPolicy())
    reports, problems = [], []
    for card in cards:
        found = findings[card.index]
        faults = [f for f in found if f.severity is Severity.UNHEALTHY]
        problems += [f"xpu{card.index} unhealthy: {f.check}: {f.detail}" for f in faults]
        reports.append(
            CardReport(
                index=card.index,
                uuid=card.uuid,
                product=card.product,
                memory_total_bytes=card.memory_total_bytes,
                firmware_version=card.firmware_version,
                healthy=not faults,
                findings=tuple(
                    {"check": f.check.value, "severity": f.severity.value, "detail": f.detail} for f in found
                ),
            )
        )
    return tuple(reports), problems


def _kml_file_problem(source: XpuSource) -> str | None:
    """Why the KML version file cannot be read (None when it can)."""
    if source.kml_version_file is None:
        return "cannot read the KML version: no KML version file given (--kml-version-file is empty)"
    path = source.host_path(source.kml_version_file)
    where = f"--kml-version-file {source.kml_version_file} under --dev-root {source.root}"
    try:
        path.read_bytes()
    except FileNotFoundError:
        return f"cannot read the KML version: {path} does not exist ({where})"
    except OSError as error:
        return f"cannot read the KML version: {path}: {error.strerror or error} ({where})"
    return None


def _unread_problem(component: str, source: XpuSource, cards: tuple[XpuDevice, ...]) -> str:
    """What was missing when the expected ``component`` version could not be read."""
    if component == "driver":
        return f"cannot read the driver version: {source.xpu_smi} printed no Driver Version"
    unread = [f"xpu{c.index}" for c in cards if c.firmware_version is None]
    return f"cannot read the firmware version of {', '.join(unread)}: xpu-smi -q printed none"


def _version_problems(
    expected: dict[str, str | None],
    found: dict[str, str | None],
    cards: tuple[XpuDevice, ...],
    source: XpuSource,
) -> list[str]:
    """One problem per component that differs (per card for firmware when the cards disagree), or
    that cannot be read (naming what was missing; the KML file is reported by the caller)."""
    problems = []
    for component in COMPONENTS:
        want = expected[component]
        if want is None:
            continue
        unread = component == "driver" or any(c.firmware_version is None for c in cards)
        if found[component] is None and component != "kml" and unread:
            problems.append(_unread_problem(component, source, cards))
            continue
        if component == "firmware" and len({c.firmware_version for c in cards}) > 1:
            for card in cards:
                if card.firmware_version != want:
                    problems.append(
                        f"firmware mismatch on xpu{card.index}: "
                        f"found {card.firmware_version}, expected {want}"
                    )
            continue
        have = found[component]
        if have != want:
            hint = (
                f" ({want} is this node's XPU-RT version; --expect-driver takes xpu-smi's Driver Version)"
                if component == "driver" and want == found["runtime"]
                else ""
            )
            problems.append(f"{component} mismatch: found {have or 'none'}, expected {want}{hint}")
    return problems


def run_preflight(
    source: XpuSource,
    expected: dict[str, str | None],
    visible: tuple[int, ...] | None,
    min_cards: int = 1,
    *,
    require_allocation: bool = False,
) -> PreflightReport:
    """Read the node and compare it with ``expected`` (keys driver, firmware, kml; None = unchecked).

    ``require_allocation``: ``visible`` None (no ``XPU_VISIBLE_DEVICES``) is a failure, not "all
    cards": in a pod it means the device plugin allocated none to this container.
    """
    found: dict[str, str | None] = dict.fromkeys(("driver", "runtime", "firmware", "kml"))
    cards: tuple[CardReport, ...] = ()
    problems: list[str] = []
    if require_allocation and visible is None:
        problems.append(
            f"{VISIBLE_DEVICES_ENV} is not set: the device plugin allocated no card to this container "
            "(it must request kunlunxin.com/xpu on a node running the Kunlun device plugin)"
        )
        return _report(source, expected, visible, found, cards, problems)
    kml_problem = _kml_file_problem(source) if expected["kml"] is not None else None
    if kml_problem is not None:
        problems.append(kml_problem)
        # the rest is still read and checked; the KML version stays unknown
        source = XpuSource(source.xpu_smi, source.root, None, source.timeout_seconds)
    try:
        listed = source.list_devices()
        by_index = {card.index: card for card in listed}
        missing = [index for index in visible or () if index not in by_index]
        if missing:
            problems.append(f"XPU_VISIBLE_DEVICES names card(s) {missing} that xpu-smi does not list")
        checked = tuple(by_index[i] for i in visible if i in by_index) if visible is not None else listed
        versions = source.versions(checked)
        found = {
            "driver": versions.driver,
            "runtime": versions.runtime,
            "firmware": versions.firmware,
            "kml": versions.kml,
        }
        cards, card_problems = _card_reports(source, checked)
        problems += card_problems
        if not listed:
            problems.append("no Kunlun card: xpu-smi lists none")
        elif len(checked) < min_cards:
            problems.append(f"{len(checked)} usable Kunlun card(s), at least {min_cards} needed")
        if checked:
            unread_kml = {**expected, "kml": None} if kml_problem is not None else expected
            problems += _version_problems(unread_kml, found, checked, source)
    except XpuToolMissingError as error:
        problems.append(
            f"cannot read the driver and firmware versions: {error} "
            f"(install the Kunlun driver tools or pass --xpu-smi / set {XPU_SMI_ENV})"
        )
    except XpuError as error:
        problems.append(f"cannot read the node: {error}")
    return _report(source, expected, visible, found, cards, problems)


def _report(
    source: XpuSource,
    expected: dict[str, str | None],
    visible: tuple[int, ...] | None,
    found: dict[str, str | None],
    cards: tuple[CardReport, ...],
    problems: list[str],
) -> PreflightReport:
    return PreflightReport(
        ok=not problems,
        reason="; ".join(p.replace("\n", " ") for p in problems) or None,
        xpu_smi=source.xpu_smi,
        dev_root=str(source.root),
        visible_devices=visible,
        expected=dict(expected),
        found=found,
        cards=cards,
    )


def summary(report: PreflightReport) -> str:
    """The one line printed when the check passes."""
    products = sorted({card.product for card in report.cards})
    f = report.found
    return (
        f"preflight ok: {len(report.cards)} healthy card(s) ({', '.join(products)}); "
        f"driver {f['driver']}, firmware {f['firmware']}, kml {f['kml']}"
    )


def _preflight_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ
    add = parser.add_argument
    add("--expect-driver", default=None, help="required driver version (xpu-smi's Driver Version)")
    add("--expect-firmware", default=None, help="required firmware version of every card")
    add("--expect-kml", default=None, help="required KML compute-library version")
    add("--min-cards", type=int, default=1, help="fail with fewer usable cards (default 1)")
    add("--json", action="store_true", help="print what was found as one JSON object")
    add(
        "--require-allocation",
        action="store_true",
        help=f"fail when {VISIBLE_DEVICES_ENV} is unset (in a pod: the device plugin allocated no card)",
    )
    add(
        "--xpu-smi",
        default=env.get(XPU_SMI_ENV) or "xpu-smi",
        help=f"the xpu-smi command (default ${XPU_SMI_ENV}, else xpu-smi on PATH)",
    )
    add(
        "--dev-root",
        default=env.get(DEV_ROOT_ENV) or "/",
        help=f"where the host's dev/, sys/ and KML version file are (default ${DEV_ROOT_ENV}, else /)",
    )
    add(
        "--kml-version-file",
        default=env.get(KML_VERSION_FILE_ENV, DEFAULT_KML_VERSION_FILE),
        help="host path of the KML version file, resolved under --dev-root ('' disables)",
    )


def run_preflight_command(args: argparse.Namespace) -> int:
    source = XpuSource(args.xpu_smi, args.dev_root, args.kml_version_file or None)
    expected = {"driver": args.expect_driver, "firmware": args.expect_firmware, "kml": args.expect_kml}
    try:
        report = run_preflight(
            source,
            expected,
            visible_card_indices(),
            min_cards=args.min_cards,
            require_allocation=args.require_allocation,
        )
    except ConfigError as error:  # a malformed XPU_VISIBLE_DEVICES: nothing was read
        report = PreflightReport(
            ok=False,
            reason=str(error),
            xpu_smi=source.xpu_smi,
            dev_root=str(source.root),
            visible_devices=None,
            expected=expected,
            found=dict.fromkeys(("driver", "runtime", "firmware", "kml")),
            cards=(),
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    if not report.ok:
        print(f"preflight failed: {report.reason}", file=sys.stderr)
        return 1
    if not args.json:
        print(summary(report))
    return 0


PREFLIGHT = Command(
    "preflight",
    "check the node's Kunlun driver/firmware/KML versions and cards; exit 1 on mismatch",
    _preflight_args,
    run_preflight_command,
)
