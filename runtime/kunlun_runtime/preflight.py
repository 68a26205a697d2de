"""``kunlun-runtime preflight``: re-check the node's real Kunlun versions and cards before loading.

The operator's init container runs it under the ``Strict`` version policy with
``--expect-driver V --expect-firmware V --expect-kml V``. It reads the cards and versions through
``kunlun_device.xpu`` (never parsing tool output here), checks the cards this container may use
(``XPU_VISIBLE_DEVICES``, else all listed) with the device plugin's health checks, and compares
each version exactly (the node labels the pods were scheduled by hold the same strings).

Exit status 0 when everything matches, 1 otherwise with one line naming every problem on stderr;
``--json`` also prints the whole finding on stdout. Invariant: ``ok`` is true only when no
problem was found; an unreadable tool is a problem, never a pass.
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
from kunlun_runtime.cli_args import Command
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.kunlun import (
    DEV_ROOT_ENV,
    KML_VERSION_FILE_ENV,
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


def _version_problems(
    expected: dict[str, str | None], found: dict[str, str | None], cards: tuple[XpuDevice, ...]
) -> list[str]:
    """One problem per component that differs (per card for firmware when the cards disagree)."""
    problems = []
    for component in COMPONENTS:
        want = expected[component]
        if want is None:
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
) -> PreflightReport:
    """Read the node and compare it with ``expected`` (keys driver, firmware, kml; None = unchecked)."""
    found: dict[str, str | None] = dict.fromkeys(("driver", "runtime", "firmware", "kml"))
    cards: tuple[CardReport, ...] = ()
    problems: list[str] = []
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
            problems += _version_problems(expected, found, checked)
    except XpuToolMissingError as error:
        problems.append(f"{error} (install the Kunlun driver tools or pass --xpu-smi / set {XPU_SMI_ENV})")
    except XpuError as error:
        problems.append(f"cannot read the node: {error}")
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
        report = run_preflight(source, expected, visible_card_indices(), min_cards=args.min_cards)
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
