"""Models: name resolution, weights and tokenizer loading, our forward pass, fingerprint."""

from .loading import LoadedModel, ModelError, load_model, resolve_device, resolve_dtype
from .presets import PRESETS
from .transformer import ModelConfig, Transformer, rotate

__all__ = ["LoadedModel", "ModelError", "ModelConfig", "PRESETS", "Transformer",
           "load_model", "resolve_device", "resolve_dtype", "rotate"]
