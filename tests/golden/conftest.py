"""Shared fixtures of the golden tests: tiny random models of every variant, and SmolLM2."""

import pytest

from tests.support.tiny_models import TINY_SPECS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def smollm2_dir():
    from kunlun_runtime.models.default_model import resolve_default_model

    return resolve_default_model(progress=False)
