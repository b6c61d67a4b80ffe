
import pytest
import torch


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
