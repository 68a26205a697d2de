"""The compatibility matrix: which driver, firmware and KML versions each runtime version supports.

Owns: the matrix's data format (the chart renders it into a ConfigMap under ``matrix.yaml``; a
copy ships in this package as ``default_matrix.yaml``), its parsing, and the check of one spec
against it. Must not talk to the API. Invariant: every problem names the spec field at fault.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from kunlun_operator.errors import SpecError
from kunlun_operator.spec import VersionsSpec

MATRIX_KEY = "matrix.yaml"
_COMPONENTS = ("driver", "firmware", "kml")


@dataclass(frozen=True, slots=True)
class MatrixEntry:
    runtime: str  # a runtime version, or a glob like "0.1.*"
    driver: frozenset[str]
    firmware: frozenset[str]
    kml: frozenset[str]


@dataclass(frozen=True, slots=True)
class Matrix:
    entries: tuple[MatrixEntry, ...]
    card_memory_bytes: Mapping[str, int]  # product label value -> bytes of memory per card

    def entry_for(self, runtime_version: str) -> MatrixEntry | None:
        """The first entry whose ``runtime`` equals or globs ``runtime_version``."""
        for entry in self.entries:
            if fnmatch.fnmatchcase(runtime_version, entry.runtime):
                return entry
        return None


def parse_matrix(text: str, *, source: str) -> Matrix:
    """Parse the ``matrix.yaml`` document.

    Raises:
        ValueError: the document does not have the documented shape; the message names
            ``source`` and the offending entry.
    """
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, Mapping) or not isinstance(doc.get("entries", []), list):
        raise ValueError(f"{source}: expected a mapping with an 'entries' list")
    entries = []
    for i, raw in enumerate(doc.get("entries", [])):
        if not isinstance(raw, Mapping) or "runtime" not in raw:
            raise ValueError(f"{source}: entries[{i}] needs 'runtime'")
        lists = {}
        for key in _COMPONENTS:
            values = raw.get(key, [])
            if not isinstance(values, list) or not values:
                raise ValueError(f"{source}: entries[{i}].{key} must be a non-empty list of versions")
            lists[key] = frozenset(str(v) for v in values)
        entries.append(MatrixEntry(runtime=str(raw["runtime"]), **lists))
    cards = doc.get("cards", {}) or {}
    memory = {}
    for product, card in cards.items():
        memory[str(product)] = parse_bytes(str(card.get("memory", "")), f"{source}: cards.{product}.memory")
    return Matrix(entries=tuple(entries), card_memory_bytes=memory)


def load_default_matrix() -> Matrix:
    """The matrix shipped in the package (used when the chart's ConfigMap is absent)."""
    text = resources.files("kunlun_operator").joinpath("default_matrix.yaml").read_text()
    return parse_matrix(text, source="kunlun_operator/default_matrix.yaml")


def merge_cards(matrix: Matrix, defaults: Matrix) -> Matrix:
    """``matrix`` with the default card table under its own (a ConfigMap may omit ``cards``)."""
    return Matrix(matrix.entries, {**defaults.card_memory_bytes, **matrix.card_memory_bytes})


def runtime_version(image: str) -> str | None:
    """The tag of ``image`` (``repo/name:0.1.0`` → ``0.1.0``); None for digests or no tag."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else None


def check_versions(matrix: Matrix, image: str, versions: VersionsSpec) -> list[SpecError]:
    """Problems of running ``image`` with ``versions``; empty when the matrix supports them.

    The policy is not consulted here: callers decide whether a problem rejects (Strict) or warns.
    """
    version = runtime_version(image)
    if version is None:
        return [
            SpecError(
                "spec.runtime.image",
                f"{image!r} has no version tag to look up in the compatibility matrix",
                reason="UnknownRuntimeVersion",
            )
        ]
    entry = matrix.entry_for(version)
    if entry is None:
        known = ", ".join(e.runtime for e in matrix.entries) or "none"
        return [
            SpecError(
                "spec.runtime.image",
                f"runtime version {version} is not in the compatibility matrix (known: {known})",
                reason="UnknownRuntimeVersion",
            )
        ]
    problems = []
    for key in _COMPONENTS:
        wanted = getattr(versions, key)
        supported: frozenset[str] = getattr(entry, key)
        if wanted is not None and wanted not in supported:
            problems.append(
                SpecError(
                    f"spec.versions.{key}",
                    f"{key} {wanted} is not supported by runtime {version} "
                    f"(supported: {', '.join(sorted(supported))})",
                    reason="UnsupportedVersions",
                )
            )
    return problems


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str, what: str) -> int:
    """A Kubernetes memory quantity (``20Gi``, ``500M``, ``1024``) in bytes.

    Raises:
        ValueError: ``text`` is not a quantity; the message starts with ``what``.
    """
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a quantity like '96Gi'") from None


def as_dict(matrix: Matrix) -> dict[str, Any]:
    """The matrix back in its documented form (for logs and the docs)."""
    return {
        "entries": [
            {"runtime": e.runtime, **{k: sorted(getattr(e, k)) for k in _COMPONENTS}} for e in matrix.entries
        ]
    }
