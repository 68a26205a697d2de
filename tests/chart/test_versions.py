"""versions.yaml is the one source of versions; nothing that restates it may drift from it."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.chart.tools import CHART, REPO, Rendered

VERSIONS = yaml.safe_load((REPO / "versions.yaml").read_text())
PROJECT_VERSION = VERSIONS["project"]["version"]


def test_pyproject_version_is_the_project_version() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == PROJECT_VERSION


def test_chart_version_and_app_version_are_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (PROJECT_VERSION, PROJECT_VERSION)


def test_every_image_tag_is_the_project_version() -> None:
    tags = {name: image["tag"] for name, image in VERSIONS["images"].items() if isinstance(image, dict)}
    assert tags == {"runtime": PROJECT_VERSION, "operator": PROJECT_VERSION, "devicePlugin": PROJECT_VERSION}


def test_rendered_images_are_the_versions_file_images(default_render: Rendered) -> None:
    images = VERSIONS["images"]
    expected = {
        key: f"{images['registry']}/{images[key]['repository']}:{images[key]['tag']}"
        for key in ("runtime", "operator", "devicePlugin")
    }
    operator = default_render.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert operator["image"] == expected["operator"]
    assert f"--default-runtime-image={expected['runtime']}" in operator["args"]
    daemonset = default_render.one("DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert {c["image"] for c in daemonset} == {expected["devicePlugin"]}


def test_chart_values_image_repositories_are_the_versions_file_ones() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    images = VERSIONS["images"]
    assert values["global"]["imageRegistry"] == images["registry"]
    assert {key: values[key]["image"]["repository"] for key in ("runtime", "operator", "devicePlugin")} == {
        key: images[key]["repository"] for key in ("runtime", "operator", "devicePlugin")
    }
    # An explicit tag in values.yaml would silently pin an image away from appVersion.
    assert {values[key]["image"]["tag"] for key in ("runtime", "operator", "devicePlugin")} == {""}


def test_compatibility_configmap_is_the_versions_file_matrix(default_render: Rendered) -> None:
    configmap = default_render.one("ConfigMap", "-compatibility")
    assert yaml.safe_load(configmap["data"]["matrix.yaml"]) == {
        "registry": VERSIONS["images"]["registry"],
        "entries": VERSIONS["compatibility"],
    }


def test_every_compatibility_entry_names_its_kunlun_runtime_image() -> None:
    repository = VERSIONS["images"]["runtime"]["repository"]
    assert [e.get("image") for e in VERSIONS["compatibility"]] == [
        f"{repository}:{e['runtime']}-kunlun" for e in VERSIONS["compatibility"]
    ]
    # the entry certifying the stack baked into the kunlun variant names the tag built on it
    stack = VERSIONS["kunlunStack"]
    certified = [
        e for e in VERSIONS["compatibility"] if stack["kml"] in e["kml"] and stack["driver"] in e["driver"]
    ]
    if "imageTag" in stack:
        assert {e["image"] for e in certified} == {f"{repository}:{stack['imageTag']}"}


def test_compatibility_matrix_covers_the_project_version_and_its_stack() -> None:
    entries = [e for e in VERSIONS["compatibility"] if e["runtime"] == PROJECT_VERSION]
    assert entries, f"no compatibility entry for runtime {PROJECT_VERSION}"
    assert any(VERSIONS["kunlunStack"]["kml"] in e["kml"] for e in entries)
    assert any(VERSIONS["kunlunStack"]["driver"] in e["driver"] for e in entries)


def test_dockerfile_build_arg_defaults_are_the_versions_file_values() -> None:
    expected = {
        "PYTHON_IMAGE": VERSIONS["build"]["pythonImage"],
        "VERSION": PROJECT_VERSION,
        **{
            f"{name.upper().replace('-', '_')}_VERSION": version
            for name, version in VERSIONS["build"]["debianPackages"].items()
        },
    }
    stack = {f"KUNLUN_{k.upper()}_VERSION": VERSIONS["kunlunStack"][k] for k in ("xre", "kml", "driver")}
    common = dict(re.findall(r"^ARG (\w+)=(\S+)$", (REPO / "images" / "common.Dockerfile").read_text(), re.M))
    assert {k: common.get(k) for k in expected if k != "VERSION"} == {
        k: v for k, v in expected.items() if k != "VERSION"
    }
    for component in ("runtime", "operator", "device-plugin"):
        text = (REPO / component / "Dockerfile").read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
        shared = {k: v for k, v in expected.items() if k in args}
        assert shared == {k: args[k] for k in shared}, component
        assert "VERSION" in args, component
        # the shared base and wheel of this release (images/common.Dockerfile)
        assert args["COMMON_IMAGE"].endswith(f"/kunlun-common:{PROJECT_VERSION}"), component
        assert args["PACKAGE_IMAGE"].endswith(f"/kunlun-package:{PROJECT_VERSION}"), component
        for name, value in stack.items():
            if name in args:
                assert args[name] == value, f"{component}: {name}"
    runtime_args = dict(re.findall(r"^ARG (\w+)=(\S+)$", (REPO / "runtime" / "Dockerfile").read_text(), re.M))
    assert {k: runtime_args.get(k) for k in stack} == stack


def test_the_kunlun_image_tag_and_checksums_are_well_formed() -> None:
    stack = VERSIONS["kunlunStack"]
    assert stack["imageTag"] == f"{PROJECT_VERSION}-kunlun"
    # Paths inside kunlun-stack/ -> sha256 (scripts/build-images.sh checks every file against it).
    assert isinstance(stack["sha256"], dict)
    for path, digest in stack["sha256"].items():
        assert not path.startswith("/") and ".." not in path.split("/"), path
        assert re.fullmatch(r"[0-9a-f]{64}", digest), path
