"""Serving: requests, scheduling, the chunk cache and its loader, the three modes, the model
runner and the sampler, composed by the engine."""

from .engine import Engine
from .recompute import Recompute
from .request import Request, Sequence
from .sampler import Sampling

__all__ = ["Engine", "Recompute", "Request", "Sampling", "Sequence"]
