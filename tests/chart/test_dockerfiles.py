"""Static checks of the three Dockerfiles (no Docker engine here: images are built in the
release pipeline). Pinned base image and packages, a non-root final USER, OCI labels that carry
the versions, and the runtime's Kunlun stack versions as recorded build arguments."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.chart.tools import REPO

COMPONENTS = ("runtime", "operator", "device-plugin")


@dataclass(frozen=True, slots=True)
class Dockerfile:
    """A Dockerfile reduced to what the checks need: instructions with continuations joined."""

    path: Path
    instructions: tuple[tuple[str, str], ...]  # (KEYWORD, arguments)

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        joined = re.sub(r"\\\n", " ", path.read_text())
        lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        return cls(path, tuple((ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines))

    def args(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for keyword, rest in self.instructions:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                out[name] = default or None
        return out

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def final_stage(self) -> list[tuple[str, str]]:
        starts = [i for i, (kw, _) in enumerate(self.instructions) if kw == "FROM"]
        return list(self.instructions[starts[-1]:])

    def resolve(self, text: str) -> str:
        args = self.args()
        return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or m.group(0), text)


def check(dockerfile: Dockerfile) -> list[str]:
    """Every problem of one Dockerfile, as readable sentences (empty when it passes)."""
    problems = []
    args = dockerfile.args()
    for name, default in args.items():
        if default is None:
            problems.append(f"ARG {name} has no default version")
    for source in dockerfile.all("FROM"):
        image = dockerfile.resolve(source.split()[0])
        if image in {"build"} or " AS " in f" {image} ":
            continue
        if "@sha256:" not in image and not re.search(r":[0-9]+\.[0-9]+(\.[0-9]+)?[^:/]*$", image):
            problems.append(f"FROM {image} is not pinned to a version or digest")
    for run in dockerfile.all("RUN"):
        for chunk in re.findall(r"apt-get install ([^&;]*)", run):
            for word in chunk.split():
                if not word.startswith("-") and "=" not in word:
                    problems.append(f"apt package {word} is not pinned (name=version)")
        for chunk in re.findall(r"pip install ([^&;]*)", run):
            for word in chunk.split():
                if word.startswith("-") or word in {".", "/install", "https://download.pytorch.org/whl/cpu"}:
                    continue
                if "==" not in word:
                    problems.append(f"pip package {word} is not pinned (name==version)")
    final = dockerfile.final_stage()
    users = [rest for kw, rest in final if kw == "USER"]
    if not users:
        problems.append("final stage has no USER")
    elif users[-1].split(":")[0] in {"root", "0"}:
        problems.append(f"final USER is root ({users[-1]})")
    labels = " ".join(rest for kw, rest in final if kw == "LABEL")
    for key in ("org.opencontainers.image.version", "org.opencontainers.image.title",
                "org.opencontainers.image.source"):
        if key not in labels:
            problems.append(f"LABEL {key} missing")
    if 'org.opencontainers.image.version="${VERSION}"' not in labels:
        problems.append("image version label is not the VERSION build argument")
    return problems


@pytest.mark.parametrize("component", COMPONENTS)
def test_dockerfile_passes_the_static_checks(component: str) -> None:
    assert check(Dockerfile.read(REPO / component / "Dockerfile")) == []


def test_runtime_records_the_kunlun_stack_versions_it_is_built_with() -> None:
    runtime = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    stack_args = {"KUNLUN_XRE_VERSION", "KUNLUN_KML_VERSION", "KUNLUN_DRIVER_VERSION"}
    assert stack_args <= set(runtime.args())
    final = " ".join(rest for _, rest in runtime.final_stage())
    for arg in stack_args:
        label = "dev.kunlun." + arg.removeprefix("KUNLUN_").removesuffix("_VERSION").lower() + "-version"
        assert f'{label}="${{{arg}}}"' in final, f"no {label} label"
        assert f"{arg}=${{{arg}}}" in final, f"{arg} not recorded in the environment"
    assert "/opt/kunlun/VERSIONS" in final


BAD = """\
FROM python:latest
ARG VERSION
RUN apt-get update && apt-get install -y curl tini=1.0 && pip install requests kopf==1.0
LABEL org.opencontainers.image.title="x"
USER root
"""


def test_the_check_catches_every_kind_of_problem(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(BAD)
    assert check(Dockerfile.read(path)) == [
        "ARG VERSION has no default version",
        "FROM python:latest is not pinned to a version or digest",
        "apt package curl is not pinned (name=version)",
        "pip package requests is not pinned (name==version)",
        "final USER is root (root)",
        "LABEL org.opencontainers.image.version missing",
        "LABEL org.opencontainers.image.source missing",
        "image version label is not the VERSION build argument",
    ]
