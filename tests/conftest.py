"""Shared fixtures. Without a CUDA GPU, Triton runs under its interpreter: it decides that when it
is first imported, so the variable is set here, before any test module imports it."""

import os

import pytest
import torch

import lazyrag  # noqa: F401  (before transformers: it keeps the checkout's kernels/ from shadowing PyPI's)

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


@pytest.fixture(scope="session")
def tiny_bf16():
    """random:tiny as `--kv-dtype auto` loads it on the CPU: it computes in fp32, its KV is bf16."""
    from lazyrag.models import load_model

    return load_model("random:tiny", device="cpu", dtype="auto")


@pytest.fixture(scope="session")
def tiny_fp8():
    """random:tiny for fp8 stores: it computes in fp32, its KV pages are e4m3 with their scales."""
    from lazyrag.models import load_model

    return load_model("random:tiny", device="cpu", dtype="fp8")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local S3 (moto's server on 127.0.0.1), started once per test run; its address and test
    credentials are in the environment obstore reads."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
                            "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(name, value)
        yield endpoint
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint, tmp_path, monkeypatch):
    """The URL of a store in a new bucket of the local S3; the catalogs of stores on object storage are
    cached under tmp_path."""
    import uuid

    import boto3

    bucket = f"lazyrag-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    monkeypatch.setenv("LAZYRAG_CACHE_DIR", str(tmp_path / "store-cache"))
    return f"s3://{bucket}/store"


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster started once per test run, which `answer --data-parallel` reuses: 2 CPUs
    and 2 logical GPUs (which CPU engines never ask for). Skipped without Ray."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as env:  # read by the Ray processes ray.init starts
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # connections stay on 127.0.0.1
        # the workers Ray starts with the cluster import the engine actor's modules (torch, transformers)
        # while they wait, so the first engines start in a moment
        env.setenv("RAY_preload_python_modules", "lazyrag.parallel.engines")
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
