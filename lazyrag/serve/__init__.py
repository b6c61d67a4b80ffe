"""Serving: requests, scheduling, the chunk cache and its loader, the three modes, the model
runner and the sampler, composed by the engine."""

from .engine import Engine
from .request import Request, Sequence
from .sampler import Sampling

__all__ = ["Engine", "Request", "Sampling", "Sequence"]
