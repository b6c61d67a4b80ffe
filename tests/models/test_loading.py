"""Resolving model names: the fingerprint, random presets, and names that are refused."""

import pytest
import torch

from lazyrag.models import ModelError, load_model
from lazyrag.models.loading import fingerprint


def test_fingerprint_changes_with_dtype_and_model(tiny):
    fp32 = tiny.fingerprint
    bf16 = load_model("random:tiny", device="cpu", dtype="bf16").fingerprint
    assert fp32 != bf16
    assert fp32 == load_model("random:tiny", device="cpu", dtype="fp32").fingerprint
    cfg = tiny.hf_config
    changed = type(cfg).from_dict({**cfg.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}})
    assert fingerprint(changed, tiny.tokenizer, "x", torch.float32) != fingerprint(cfg, tiny.tokenizer, "x", torch.float32)


def test_unknown_models_are_refused(tmp_path):
    with pytest.raises(ModelError, match="random:<preset>"):
        load_model(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ModelError, match="unknown random preset"):
        load_model("random:gpt5", device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelError, match="gpt2"):
        load_model(str(tmp_path), device="cpu")


def test_auto_is_bf16_kv_on_every_device_and_the_cpu_computes_in_fp32(tiny):
    from lazyrag.models.loading import compute_dtype, resolve_dtype

    assert resolve_dtype("auto") == torch.bfloat16
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for kv in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        assert compute_dtype(kv, cpu) == torch.float32  # the CPU never computes in 16 bits
    assert compute_dtype(torch.bfloat16, cuda) == torch.bfloat16 and compute_dtype(torch.float32, cuda) == torch.float32
    assert compute_dtype(torch.float8_e4m3fn, cuda) == torch.bfloat16
    auto = load_model("random:tiny", device="cpu")
    assert (auto.kv_dtype, auto.dtype) == (torch.bfloat16, torch.float32)
    assert auto.fingerprint == load_model("random:tiny", device="cpu", dtype="bf16").fingerprint != tiny.fingerprint
