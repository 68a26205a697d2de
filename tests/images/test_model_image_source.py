"""A model shipped as an image, on a cluster without image volumes: the operator's ``model-fetch``
init container, run as the pod runs it (its image, command, user and mount), really copies the
image's ``/models`` into the volume the runtime then reads at ``/models``."""

from __future__ import annotations

from pathlib import Path

from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.spec.service import parse_spec
from tests.images.conftest import Podman
from tests.unit.operator.factories import make_raw_spec, make_ref

MODEL_IMAGE = "localhost/kunlun-test-model:fetch"


def test_model_fetch_copies_the_images_models_into_the_model_volume(podman: Podman, tmp_path: Path) -> None:
    podman.build("base")  # the Debian base the script bootstraps: it has sh and cp
    context = tmp_path / "context"
    context.mkdir()
    (context / "Containerfile").write_text(
        "FROM localhost/kunlun-base:bookworm\n"
        'RUN mkdir -p /models/tok && echo \'{"architectures": ["LlamaForCausalLM"]}\' > /models/config.json'
        " && echo vocab > /models/tok/vocab.txt && ln -s tok/vocab.txt /models/vocab.txt"
        " && chmod -R a+rX /models\n"
    )
    podman("build", "-t", MODEL_IMAGE, str(context))
    spec = parse_spec(make_raw_spec(model={"name": "m", "source": {"image": {"reference": MODEL_IMAGE}}}))
    pod = build_deployment(
        make_ref(), spec, image="unused:1", config_hash="h", image_volumes=False, replicas=1
    )["spec"]["template"]["spec"]
    [fetcher] = [c for c in pod["initContainers"] if c["name"] == "model-fetch"]
    [mount] = fetcher["volumeMounts"]
    volume = tmp_path / "model-volume"  # the pod's emptyDir
    volume.mkdir()
    volume.chmod(0o777)
    user = str(pod["securityContext"]["runAsUser"])  # the pod's user, as the kubelet runs it
    try:
        podman(
            "run", "--rm", "--user", user, "--read-only", "-v", f"{volume}:{mount['mountPath']}",
            "--entrypoint", fetcher["command"][0], fetcher["image"], *fetcher["command"][1:],
        )  # fmt: skip
    finally:
        podman("rmi", "--force", MODEL_IMAGE, check=False)
    assert (volume / "config.json").read_text() == '{"architectures": ["LlamaForCausalLM"]}\n'
    assert (volume / "tok" / "vocab.txt").read_text() == "vocab\n"
    assert (volume / "vocab.txt").is_symlink() and (volume / "vocab.txt").read_text() == "vocab\n"
    [runtime] = [c for c in pod["containers"] if c["name"] == "runtime"]
    assert {"name": mount["name"], "mountPath": "/models", "readOnly": True} in runtime["volumeMounts"]
