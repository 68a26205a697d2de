"""Health checks of Kunlun cards: which faults exist now, and how serious each one is.

Checks (`Check`): device node missing, card missing from `xpu-smi`, uncorrectable ECC errors,
temperature over the warn or the critical threshold, `xpu-smi` failing. A `HealthPolicy` maps each
check to a `Severity`: ignore (dropped), warn (metric and log only), unhealthy (the card is
withdrawn from scheduling). Pure functions; the stateful recovery logic is in `health_tracker`.

Invariant: a failed `xpu-smi` call yields `tool-error` findings for every card, never readings of 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kunlun_device.errors import ConfigError
from kunlun_device.xpu.model import SmiTable, XpuDevice


class Severity(StrEnum):
    IGNORE = "ignore"
    WARN = "warn"
    UNHEALTHY = "unhealthy"


class Check(StrEnum):
    DEVICE_NODE_MISSING = "device-node-missing"
    CARD_MISSING = "card-missing"
    ECC_UNCORRECTABLE = "ecc-uncorrectable"
    TEMPERATURE_HIGH = "temperature-high"
    TEMPERATURE_CRITICAL = "temperature-critical"
    TOOL_ERROR = "tool-error"


DEFAULT_SEVERITIES: Mapping[Check, Severity] = {
    Check.DEVICE_NODE_MISSING: Severity.UNHEALTHY,
    Check.CARD_MISSING: Severity.UNHEALTHY,
    Check.ECC_UNCORRECTABLE: Severity.UNHEALTHY,
    Check.TEMPERATURE_HIGH: Severity.WARN,
    Check.TEMPERATURE_CRITICAL: Severity.UNHEALTHY,
    # one failed xpu-smi call should not empty the node; a card that is really gone fails the
    # device-node or card-missing checks as well
    Check.TOOL_ERROR: Severity.WARN,
}


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How checks are judged and how long a fault must stay cleared before a card is Healthy."""

    severities: Mapping[Check, Severity] = field(default_factory=lambda: dict(DEFAULT_SEVERITIES))
    temperature_warn_celsius: float = 85.0
    temperature_critical_celsius: float = 95.0
    recovery_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One check that currently fails on one card."""

    index: int
    check: Check
    severity: Severity
    detail: str


def parse_severities(text: str, field_name: str = "--health-policy") -> dict[Check, Severity]:
    """Parse `check=severity,...` overrides onto the defaults.

    Raises:
        ConfigError: an unknown check or severity, naming `field_name` and the entry.
    """
    severities = dict(DEFAULT_SEVERITIES)
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, level = entry.partition("=")
        if not sep:
            raise ConfigError(field_name, f"entry {entry!r} is not check=severity")
        try:
            check = Check(name.strip())
        except ValueError:
            known = ", ".join(c.value for c in Check)
            raise ConfigError(field_name, f"unknown check {name.strip()!r} (known: {known})") from None
        try:
            severities[check] = Severity(level.strip())
        except ValueError:
            known = ", ".join(s.value for s in Severity)
            raise ConfigError(field_name, f"unknown severity {level.strip()!r} (known: {known})") from None
    return severities


def evaluate(
    devices: tuple[XpuDevice, ...],
    table: SmiTable | None,
    tool_error: str | None,
    node_present: Callable[[int], bool],
    policy: HealthPolicy,
) -> dict[int, tuple[Finding, ...]]:
    """Run every check on every known card.

    Args:
        devices: the cards discovered at start-up (the set kubelet knows).
        table: the current `xpu-smi` summary, or None when the call failed.
        tool_error: the failure message when `table` is None.
        node_present: whether `/dev/xpu<index>` exists.
    Returns:
        For each card index, its findings whose severity is not `ignore` (empty when all pass).
    """
    readings = {card.index: card for card in table.cards} if table is not None else {}
    results: dict[int, tuple[Finding, ...]] = {}
    for device in devices:
        found: list[tuple[Check, str]] = []
        if not node_present(device.index):
            found.append((Check.DEVICE_NODE_MISSING, f"{device.device_path} does not exist"))
        card = readings.get(device.index)
        if table is None:
            found.append((Check.TOOL_ERROR, tool_error or "xpu-smi failed"))
        elif card is None:
            found.append((Check.CARD_MISSING, "not listed by xpu-smi"))
        else:
            if card.ecc_uncorrectable_errors:
                found.append(
                    (Check.ECC_UNCORRECTABLE, f"{card.ecc_uncorrectable_errors} uncorrectable ECC errors")
                )
            temp = card.temperature_celsius
            if temp is not None and temp >= policy.temperature_critical_celsius:
                found.append(
                    (Check.TEMPERATURE_CRITICAL, f"{temp:g}C >= {policy.temperature_critical_celsius:g}C")
                )
            elif temp is not None and temp >= policy.temperature_warn_celsius:
                found.append((Check.TEMPERATURE_HIGH, f"{temp:g}C >= {policy.temperature_warn_celsius:g}C"))
        findings = (
            Finding(device.index, check, policy.severities.get(check, Severity.UNHEALTHY), detail)
            for check, detail in found
        )
        results[device.index] = tuple(f for f in findings if f.severity is not Severity.IGNORE)
    return results
