"""Static checks of the three Dockerfiles and the stages they share (images/common.Dockerfile):
pinned base image and packages, a non-root USER and OCI labels that carry the versions in every
image target, the shared stages written once, and the runtime's Kunlun stack versions as recorded
build arguments. tests/images builds and runs the images themselves (with podman)."""

from __future__ import annotations

import re
import sys
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
                # `ARG NAME` alone inside a stage re-imports a global ARG declared with its default.
                out[name] = default or out.get(name)
        return out

    def stage_names(self) -> set[str]:
        return {rest.split()[-1] for rest in self.all("FROM") if " AS " in f" {rest.upper()} "}

    def stage(self, name: str | None = None) -> list[tuple[str, str]]:
        """The instructions of stage ``name`` (default: the last one), its parent stages' first:
        what the image built with ``--target name`` is made of."""
        starts = [i for i, (kw, _) in enumerate(self.instructions) if kw == "FROM"]
        bounds = dict(zip(starts, [*starts[1:], len(self.instructions)], strict=True))
        by_name = {
            self.instructions[i][1].split()[-1]: i
            for i in starts
            if " AS " in f" {self.instructions[i][1].upper()} "
        }
        start = starts[-1] if name is None else by_name[name]
        own = list(self.instructions[start : bounds[start]])
        parent = own[0][1].split()[0]
        return (self.stage(parent) if parent in by_name else []) + own

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def resolve(self, text: str) -> str:
        args = self.args()
        return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or m.group(0), text)


_PIP_VALUE_OPTIONS = {"-r", "--requirement", "--index-url", "-i", "--prefix", "-c", "--constraint"}


def check(dockerfile: Dockerfile, targets: tuple[str | None, ...] | None = ()) -> list[str]:
    """Every problem of one Dockerfile and of each of its image ``targets`` (default: the last
    stage; ``None``: none, for a file of shared stages), as readable sentences (empty when it passes)."""
    problems = []
    args = dockerfile.args()
    for name, default in args.items():
        if default is None:
            problems.append(f"ARG {name} has no default version")
    for source in dockerfile.all("FROM"):
        image = dockerfile.resolve(source.split()[0])
        if image in dockerfile.stage_names():
            continue
        if "@sha256:" not in image and not re.search(r":[0-9]+\.[0-9]+(\.[0-9]+)?[^:/]*$", image):
            problems.append(f"FROM {image} is not pinned to a version or digest")
    for run in dockerfile.all("RUN"):
        for chunk in re.findall(r"apt-get install ([^&;]*)", run):
            for word in chunk.split():
                if not word.startswith("-") and "=" not in word:
                    problems.append(f"apt package {word} is not pinned (name=version)")
        for chunk in re.findall(r"pip install ([^&;]*)", run):
            if "--extra-index-url" in chunk:
                problems.append("pip install mixes indexes (--extra-index-url)")
            words = chunk.split()
            for i, word in enumerate(words):
                local = word in {".", "/install"} or word.endswith(".whl")  # built or checked here
                if word.startswith("-") or local or words[i - 1] in _PIP_VALUE_OPTIONS:
                    continue
                if "==" not in word:
                    problems.append(f"pip package {word} is not pinned (name==version)")
    for target in () if targets is None else targets or (None,):
        problems += check_image(dockerfile.stage(target), "" if target is None else f"{target}: ")
    return problems


def check_image(final: list[tuple[str, str]], where: str = "") -> list[str]:
    """The problems of one image target (its stage and its parents)."""
    problems = []
    users = [rest for kw, rest in final if kw == "USER"]
    if not users:
        problems.append(f"{where}final stage has no USER")
    elif users[-1].split(":")[0] in {"root", "0"}:
        problems.append(f"{where}final USER is root ({users[-1]})")
    labels = " ".join(rest for kw, rest in final if kw == "LABEL")
    for key in (
        "org.opencontainers.image.version",
        "org.opencontainers.image.title",
        "org.opencontainers.image.source",
    ):
        if key not in labels:
            problems.append(f"{where}LABEL {key} missing")
    if 'org.opencontainers.image.version="${VERSION}"' not in labels:
        problems.append(f"{where}image version label is not the VERSION build argument")
    return problems


# The image targets of each Dockerfile (None: the last stage); the last stage is the default.
TARGETS: dict[str, tuple[str | None, ...]] = {
    "runtime": ("cpu", "cuda", "kunlun"),
    "operator": (None,),
    "device-plugin": ("host-xpu-smi", "with-stack"),
}


@pytest.mark.parametrize("component", COMPONENTS)
def test_dockerfile_passes_the_static_checks(component: str) -> None:
    assert check(Dockerfile.read(REPO / component / "Dockerfile"), TARGETS[component]) == []


def test_the_shared_stages_are_pinned_and_written_once() -> None:
    common = Dockerfile.read(REPO / "images" / "common.Dockerfile")
    assert check(common, None) == []  # no image of its own: each image sets its USER and labels
    assert common.stage_names() == {"common", "package"}
    assert any("pip wheel" in run for run in common.all("RUN"))
    for component in COMPONENTS:
        dockerfile = Dockerfile.read(REPO / component / "Dockerfile")
        bases = {dockerfile.resolve(f.split()[0]) for f in dockerfile.all("FROM")} - dockerfile.stage_names()
        assert bases == {
            "ghcr.io/kunlun-inference/kunlun-common:0.1.0",
            "ghcr.io/kunlun-inference/kunlun-package:0.1.0",
        }, component
        for run in dockerfile.all("RUN"):  # what the shared stages do is done there only
            assert "pip wheel" not in run and "useradd" not in run and "python3 -m venv" not in run, component


def test_a_plain_runtime_build_is_the_cpu_image() -> None:
    runtime = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    assert runtime.stage() == runtime.stage("cpu")


def test_runtime_records_the_kunlun_stack_versions_it_is_built_with() -> None:
    runtime = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    stack_args = {"KUNLUN_XRE_VERSION", "KUNLUN_KML_VERSION", "KUNLUN_DRIVER_VERSION"}
    assert stack_args <= set(runtime.args())
    final = " ".join(rest for _, rest in runtime.stage("kunlun"))
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


# -- every module an image's code imports at load time is installed by its pinned packages ----------

IMAGE_PACKAGES = {  # Dockerfile folder -> the package its entry point runs
    "runtime": "kunlun_runtime",
    "operator": "kunlun_operator",
    "device-plugin": "kunlun_device",
}
SOURCE_ROOTS = {"kunlun_runtime": "runtime", "kunlun_operator": "operator", "kunlun_device": "device-plugin"}


def module_file(module: str) -> Path | None:
    """The source file of one of our modules, e.g. kunlun_device.labels → device-plugin/…/labels.py."""
    top = module.split(".")[0]
    if top not in SOURCE_ROOTS:
        return None
    base = REPO / SOURCE_ROOTS[top] / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def load_time_imports(package: str) -> set[str]:
    """Third-party top-level modules imported at module level by `package` and by every module of
    ours it reaches that way (imports inside functions are lazy and optional, not counted)."""
    import ast

    files = set((REPO / SOURCE_ROOTS[package] / package).rglob("*.py"))
    seen: set[Path] = set()
    third_party: set[str] = set()
    while files - seen:
        path = (files - seen).pop()
        seen.add(path)
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in SOURCE_ROOTS:
                    parts = name.split(".")
                    files |= {f for i in range(1, len(parts) + 1) if (f := module_file(".".join(parts[:i])))}
                elif top not in sys.stdlib_module_names:
                    third_party.add(top)
    return third_party


def installed_modules(pins: set[str]) -> set[str]:
    """Top-level modules that `pip install <pins>` provides: the pinned distributions and their
    requirements, resolved from the metadata of the environment the tests run in."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    wanted = {canonicalize_name(p) for p in pins}
    done: set[str] = set()
    while wanted - done:
        name = (wanted - done).pop()
        done.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                wanted.add(canonicalize_name(req.name))
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if any(canonicalize_name(d) in done for d in dists)
    }


def pinned_packages(dockerfile: Dockerfile) -> set[str]:
    pins = set()
    for run in dockerfile.all("RUN"):
        for chunk in re.findall(r"pip install ([^&;]*)", run):
            pins |= {w.split("==")[0] for w in chunk.split() if "==" in w and w.split("==")[0] != "pip"}
            words = chunk.split()
            for i, word in enumerate(words[1:], 1):
                # Lock files made in the build (the lock less torch) are subsets of the repository's.
                if words[i - 1] in {"-r", "--requirement"} and (REPO / word).is_file():
                    pins |= {name for name, _ in lock_entries(REPO / word)}
    return pins


def lock_entries(path: Path) -> list[tuple[str, str]]:
    """``(name, requirement line)`` of each requirement in a pip lock file (continuations joined)."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.split("#", 1)[0].strip() for line in joined.splitlines()]
    return [(re.split(r"[ =@<>!~;\[]", line, maxsplit=1)[0], line) for line in lines if line]


def test_runtime_image_installs_a_hash_pinned_lock_from_one_index() -> None:
    dockerfile = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    installs = [c for run in dockerfile.all("RUN") for c in re.findall(r"pip install ([^&;]*)", run)]
    locked = [c for c in installs if "-r runtime/requirements.lock" in c]
    assert len(locked) == 1 and "--require-hashes" in locked[0].split(), installs
    assert not any("--extra-index-url" in c for c in installs)
    entries = lock_entries(REPO / "runtime" / "requirements.lock")
    assert len(entries) > 40  # transitive dependencies included
    for name, line in entries:
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", line), f"{name} has no hash"
        assert "==" in line or " @ https://" in line, f"{name} is not pinned"
    by_name = dict(entries)
    assert by_name["torch"].startswith(
        "torch @ https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-"
    )


@pytest.mark.parametrize("component", COMPONENTS)
def test_image_installs_every_module_its_code_imports_at_load_time(component: str) -> None:
    dockerfile = Dockerfile.read(REPO / component / "Dockerfile")
    needed = load_time_imports(IMAGE_PACKAGES[component])
    assert needed, "no third-party import found: the scan is broken"
    assert needed - installed_modules(pinned_packages(dockerfile)) == set()


def test_load_time_import_scan_follows_our_own_modules() -> None:
    # kunlun_operator imports kunlun_device.labels; the scan must follow it (and not the whole of
    # kunlun_device: the operator image has no gRPC).
    assert "grpc" not in load_time_imports("kunlun_operator")
    assert "grpc" in load_time_imports("kunlun_device")


def test_runtime_image_default_command_is_accepted_by_the_runtime_cli() -> None:
    import contextlib
    import io
    import json

    from kunlun_runtime.commands import cli  # here, not at the top: it imports torch

    runtime = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    entrypoint = json.loads(runtime.all("ENTRYPOINT")[-1])
    command = json.loads(runtime.all("CMD")[-1])
    assert entrypoint == ["/usr/bin/tini", "--", "kunlun-runtime"]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = cli.build_parser().parse_args(command)
        except SystemExit:
            pytest.fail(f"kunlun-runtime rejects the image's CMD {command}: {err.getvalue()}")
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)


def test_the_installed_package_carries_every_kernel_source() -> None:
    # An installed (not editable) runtime compiles its CPU kernels from the package's own files, so
    # every file the build reads must be package data: a header left out broke the image's build.
    import tomllib

    from kunlun_runtime.layers import cpu_kernels

    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    for path in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        assert any(path.match(pattern) for pattern in patterns), f"{path.name} is not package data"
    on_disk = {path for path in cpu_kernels.CSRC.rglob("*") if path.is_file()}
    assert on_disk == {*cpu_kernels.SOURCES, *cpu_kernels.HEADERS}


@pytest.mark.parametrize("target", TARGETS["runtime"])
def test_runtime_images_make_cpu_kernels_that_do_not_load_a_start_error(target: str) -> None:
    # An image whose kernels do not load (a broken build, a wrong ABI) must refuse to start, not
    # serve at a fraction of the speed: --require-native-kernels' environment default.
    runtime = Dockerfile.read(REPO / "runtime" / "Dockerfile")
    env = " ".join(rest for keyword, rest in runtime.stage(target) if keyword == "ENV").split()
    assert "KUNLUN_REQUIRE_NATIVE_KERNELS=1" in env
