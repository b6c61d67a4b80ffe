"""Serving: requests, scheduling, the chunk cache, the three modes and the model runner."""

from .engine import Engine, Request, Sampling

__all__ = ["Engine", "Request", "Sampling"]
