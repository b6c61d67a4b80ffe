"""The kernel tests' shared fixture."""

import importlib.util

import pytest
import torch

from lazyrag import kernels


@pytest.fixture
def interp(monkeypatch):
    """CPU tensors through the Triton interpreter, split scratch NaN-poisoned. On a CPU machine
    these tests are the kernels' only check: cpu_backend refuses (an error, never a skip) when
    triton was imported compiled."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton is compiled, and the GPU tests cover the kernels")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    from lazyrag.kernels import splits

    monkeypatch.setattr(splits, "POISON_SCRATCH", True)
    with kernels.cpu_backend("triton"):
        yield
