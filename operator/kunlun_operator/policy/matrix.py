"""The compatibility matrix: which driver, firmware and KML versions each runtime version supports,
and the runtime image certified on them.

Owns: the matrix's data format (the chart renders it into a ConfigMap under ``matrix.yaml``; a
copy ships in this package as ``default_matrix.yaml``), its parsing, the choice of the runtime
image for a spec without one (``select_image``) and the check of one spec against it. Must not
talk to the API. Invariant: every problem names the spec field at fault.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import yaml

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.quantity import parse_bytes
from kunlun_operator.spec.values import VersionsSpec

MATRIX_KEY = "matrix.yaml"
_COMPONENTS = ("driver", "firmware", "kml")
#: The runtime image variant built on the Kunlun stack (``runtime/Dockerfile`` target ``kunlun``):
#: its tag ``<version>-kunlun`` is runtime ``<version>`` for the matrix. The ``cpu`` and ``cuda``
#: variants are certified on no Kunlun stack, so their tags (``0.1.0-cpu``) match no entry: a
#: Strict service cannot run them while holding XPUs.
_KUNLUN_SUFFIX = re.compile(r"-kunlun$")


@dataclass(frozen=True, slots=True)
class MatrixEntry:
    runtime: str  # a runtime version, or a glob like "0.1.*"
    driver: frozenset[str]
    firmware: frozenset[str]
    kml: frozenset[str]
    #: The runtime image (its ``kunlun`` variant) certified on these versions, a full reference
    #: (the matrix's ``registry`` already applied); None: the entry names no image.
    image: str | None = None

    def certifies(self, versions: VersionsSpec) -> bool:
        """True when every version ``versions`` sets is one this entry lists (unset ones match)."""
        return all(
            getattr(versions, key) is None or getattr(versions, key) in getattr(self, key)
            for key in _COMPONENTS
        )


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

    def entries_for_image(self, image: str) -> tuple[MatrixEntry, ...]:
        """The entries naming ``image`` itself; when none does, every entry of its tag's runtime
        version (an admin's extra entry for a newly certified driver counts like the first one;
        empty when neither)."""
        named = tuple(entry for entry in self.entries if entry.image == image)
        if named:
            return named
        version = runtime_version(image)
        if version is None:
            return ()
        return tuple(entry for entry in self.entries if fnmatch.fnmatchcase(version, entry.runtime))

    def under_registry_of(self, image: str) -> Matrix:
        """This matrix with every entry's image moved to the repository directory of ``image``.

        For the packaged matrix, used when the chart's ConfigMap is absent or malformed: its images
        name the public registry, and a mirrored or air-gapped cluster must keep pulling from the
        directory its own ``--default-runtime-image`` names, never silently from the internet.
        """
        directory = image.split("@", 1)[0].rsplit("/", 1)[0] if "/" in image else None

        def moved(entry: MatrixEntry) -> MatrixEntry:
            if entry.image is None:
                return entry
            name = entry.image.rsplit("/", 1)[-1]
            return replace(entry, image=name if directory is None else f"{directory}/{name}")

        return replace(self, entries=tuple(moved(entry) for entry in self.entries))


@dataclass(frozen=True, slots=True)
class CertifiedStack:
    """The node versions one matrix entry lets a service run on: per component, the versions
    allowed (the entry's own, narrowed to the one the service locks)."""

    driver: tuple[str, ...]
    firmware: tuple[str, ...]
    kml: tuple[str, ...]


def certified_stacks(matrix: Matrix, image: str, versions: VersionsSpec) -> tuple[CertifiedStack, ...]:
    """The stacks ``image`` may run on with ``versions``: one per entry of the image certifying
    them (``Matrix.entries_for_image``), each component narrowed to the version ``versions`` sets
    (all of the entry's when unset); duplicates dropped, matrix order kept. Empty when no entry
    certifies them (``check_versions`` reports why)."""
    stacks: list[CertifiedStack] = []
    for entry in matrix.entries_for_image(image):
        if not entry.certifies(versions):
            continue
        allowed = {
            key: (wanted,)
            if (wanted := getattr(versions, key)) is not None
            else tuple(sorted(getattr(entry, key)))
            for key in _COMPONENTS
        }
        stack = CertifiedStack(**allowed)
        if stack not in stacks:
            stacks.append(stack)
    return tuple(stacks)


def select_image(matrix: Matrix, versions: VersionsSpec, fallback: str) -> str:
    """The runtime image for a spec without ``spec.runtime.image``.

    The image of the first entry (in matrix order) that certifies ``versions`` and names one;
    ``fallback`` (the operator's ``--default-runtime-image``) when no such entry names an image
    (a matrix from before entries carried images, or versions outside the matrix under policy
    Warn or Off, which ``check_versions`` then reports).
    """
    for entry in matrix.entries:
        if entry.image is not None and entry.certifies(versions):
            return entry.image
    return fallback


def resolve_image(image: str, registry: str | None) -> str:
    """An entry's ``image`` as a full reference: ``repository:tag`` goes under ``registry``. As in
    Docker's rule, a reference is already full only when its first component names a registry
    (has a ``.`` or ``:``, or is ``localhost``): ``team/rt:1`` still goes under ``registry``."""
    first = image.split("/", 1)[0]
    has_registry = "/" in image and ("." in first or ":" in first or first == "localhost")
    if registry is None or has_registry:
        return image
    return f"{registry.rstrip('/')}/{image}"


def parse_matrix(text: str, *, source: str) -> Matrix:
    """Parse the ``matrix.yaml`` document.

    Raises:
        ValueError: the document does not have the documented shape; the message names
            ``source`` and the offending entry.
    """
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, Mapping) or not isinstance(doc.get("entries", []), list):
        raise ValueError(f"{source}: expected a mapping with an 'entries' list")
    registry = doc.get("registry")
    if registry is not None and (not isinstance(registry, str) or not registry):
        raise ValueError(f"{source}: registry must be a non-empty string")
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
        image = raw.get("image")
        if image is not None and (not isinstance(image, str) or ":" not in image.rsplit("/", 1)[-1]):
            raise ValueError(f"{source}: entries[{i}].image must be 'repository:tag', got {image!r}")
        entries.append(
            MatrixEntry(
                runtime=str(raw["runtime"]),
                **lists,
                image=None if image is None else resolve_image(image, registry),
            )
        )
    cards = doc.get("cards", {}) or {}
    memory = {}
    for product, card in cards.items():
        try:
            memory[str(product)] = parse_bytes(str(card.get("memory", "")), f"cards.{product}.memory")
        except SpecError as error:  # the matrix is the admin's, not the service's: a plain ValueError
            raise ValueError(f"{source}: {error}") from None
    return Matrix(entries=tuple(entries), card_memory_bytes=memory)


def load_default_matrix() -> Matrix:
    """The matrix shipped in the package (used when the chart's ConfigMap is absent)."""
    text = resources.files("kunlun_operator.policy").joinpath("default_matrix.yaml").read_text()
    return parse_matrix(text, source="kunlun_operator/policy/default_matrix.yaml")


def merge_cards(matrix: Matrix, defaults: Matrix) -> Matrix:
    """``matrix`` with the default card table under its own (a ConfigMap may omit ``cards``)."""
    return Matrix(matrix.entries, {**defaults.card_memory_bytes, **matrix.card_memory_bytes})


def runtime_version(image: str) -> str | None:
    """The runtime version in the tag of ``image`` (``repo/name:0.1.0`` and its Kunlun variant
    ``repo/name:0.1.0-kunlun`` → ``0.1.0``; ``:0.1.0-cpu`` stays ``0.1.0-cpu``); None for digests
    or no tag."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return _KUNLUN_SUFFIX.sub("", last.rsplit(":", 1)[1]) if ":" in last else None


def check_versions(matrix: Matrix, image: str, versions: VersionsSpec) -> list[SpecError]:
    """Problems of running ``image`` with ``versions``; empty when the matrix supports them.

    The policy is not consulted here: callers decide whether a problem rejects (Strict) or warns.
    """
    candidates = matrix.entries_for_image(image)
    version = runtime_version(image)
    if not candidates and version is None:
        return [
            SpecError(
                "spec.runtime.image",
                f"{image!r} has no version tag to look up in the compatibility matrix",
                reason="UnknownRuntimeVersion",
            )
        ]
    if not candidates:
        known = ", ".join(e.runtime for e in matrix.entries) or "none"
        return [
            SpecError(
                "spec.runtime.image",
                f"runtime version {version} is not in the compatibility matrix (known: {known})",
                reason="UnknownRuntimeVersion",
            )
        ]
    if any(entry.certifies(versions) for entry in candidates):
        return []
    entry = candidates[0]
    problems = []
    for key in _COMPONENTS:
        wanted = getattr(versions, key)
        supported: frozenset[str] = getattr(entry, key)
        if wanted is not None and wanted not in supported:
            problems.append(
                SpecError(
                    f"spec.versions.{key}",
                    f"{key} {wanted} is not supported by runtime {version or entry.runtime} "
                    f"(supported: {', '.join(sorted(supported))})",
                    reason="UnsupportedVersions",
                )
            )
    return problems


def as_dict(matrix: Matrix) -> dict[str, Any]:
    """The matrix back in its documented form (for logs and the docs); images as full references."""
    return {
        "entries": [
            {
                "runtime": e.runtime,
                **{k: sorted(getattr(e, k)) for k in _COMPONENTS},
                **({"image": e.image} if e.image is not None else {}),
            }
            for e in matrix.entries
        ]
    }
