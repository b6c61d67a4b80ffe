"""Shared fixtures. Without a CUDA GPU, Triton runs under its interpreter: it decides that when it
is first imported, so the variable is set here, before any test module imports it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm():
    """The default model on the CPU in fp32 (fetched once into LAZYRAG_HOME)."""
    from lazyrag.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def tiny():
    from lazyrag.models import load_model

    return load_model("random:tiny", device="cpu", dtype="fp32")
