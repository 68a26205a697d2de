"""Versions as DRA `version` attributes: semantic versions (semver.org 2.0.0), at most 64 characters.

Kunlun versions are not semver: the driver is 4-part (``5.0.21.26``), the firmware 6-part
(``1.0.2.14.1.54``), KML may be 2-part. `to_semver` maps them one way, documented in
docs/device-plugin.md "DRA":

- the first three dot-separated parts become major.minor.patch (missing ones are 0, leading zeros
  are dropped: ``3.2`` -> ``3.2.0``);
- any further parts become the pre-release, dot-separated (``5.0.21.26`` -> ``5.0.21-26``,
  ``1.0.2.14.1.54`` -> ``1.0.2-14.1.54``), so builds of one release compare numerically part by
  part and two builds never compare equal (build metadata, ``+26``, would be ignored by semver
  comparison and make ``5.0.21.26 == 5.0.21.27``);
- a version that already is semver is kept as it is.

The cost: ``5.0.21-26`` sorts before a plain ``5.0.21``; our tools never print the 3-part form of
a 4-part version, so comparisons between the versions a node reports stay right.

Invariant: the result matches `SEMVER` and is at most `MAX_LENGTH` long, or it is None (the caller
leaves the attribute out and logs why).
"""

from __future__ import annotations

import re

MAX_LENGTH = 64
_NUMBER = r"(?:0|[1-9][0-9]*)"
_IDENT = r"(?:[0-9A-Za-z-]+)"
SEMVER = re.compile(
    rf"^{_NUMBER}\.{_NUMBER}\.{_NUMBER}"
    rf"(?:-(?:{_NUMBER}|[0-9]*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:{_NUMBER}|[0-9]*[A-Za-z-][0-9A-Za-z-]*))*)?"
    rf"(?:\+{_IDENT}(?:\.{_IDENT})*)?$"
)
_PART = re.compile(r"^[0-9A-Za-z-]+$")


def _identifier(part: str) -> str:
    """A pre-release identifier: numeric ones lose their leading zeros (semver forbids them)."""
    return str(int(part)) if part.isdigit() else part


def to_semver(text: str | None) -> str | None:
    """The semver form of version `text` (see the module docstring), or None when it has none.

    None for: None, an empty string, a major/minor/patch that is not a number, a part that is empty
    or holds characters semver does not allow, or a result longer than 64 characters.
    """
    if text is None:
        return None
    value = text.strip().removeprefix("v")
    if SEMVER.match(value):
        return value if len(value) <= MAX_LENGTH else None
    parts = value.split(".")
    if not value or not all(_PART.match(part) for part in parts):
        return None
    release, extra = parts[:3], parts[3:]
    if not all(part.isdigit() for part in release):
        return None
    release += ["0"] * (3 - len(release))
    result = ".".join(str(int(part)) for part in release)
    if extra:
        result += "-" + ".".join(_identifier(part) for part in extra)
    if not SEMVER.match(result) or len(result) > MAX_LENGTH:
        return None
    return result
