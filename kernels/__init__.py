"""Lazy-attention kernels: attention over shared, position-free KV pages with deferred RoPE.

Positions (DESIGN.md section 2)
-------------------------------
RoPE is Hugging Face "rotate_half" (non-interleaved): for head_dim ``D``, halves
``x1 = x[:D/2]``, ``x2 = x[D/2:]`` and angles ``theta_i = pos * inv_freq[i]``, the rotation is
``R(pos) x = [x1*cos - x2*sin, x2*cos + x1*sin]``. ``inv_freq`` is the model's own float32
[D/2] tensor (it carries the rope scaling); the kernels never recompute it. Rotation maths is
fp32 (positions are int32, subtracted first, then converted); the rotated query is cast to
the input dtype for the dot products; accumulation is fp32. Compiled kernels take cos/sin
from the GPU's approximations after reducing the angle to [-pi, pi] (within 1e-6 of the
precise values for angles under 2**17); the interpreter and the reference use precise ones.

Paged KV pool (per layer)
-------------------------
``k_pages``, ``v_pages``: ``[num_pages, page_size, kv_heads, head_dim]``, fp16 / bf16 / fp32,
the last three dims contiguous (any stride on the first). ``page_size`` is a power of two in
16..128; ``head_dim`` is 64 or 128. Keys are stored ALREADY ROTATED at their *stored*
positions; values as they are.

A request reads pages through a :class:`PageTable` (all int32): entry ``p`` of request ``b``
is physical page ``ids[b, p]`` with ``length[b, p]`` valid tokens; key ``j`` of it has stored
position ``start[b, p] + j`` and *logical* position ``start[b, p] + delta[b, p] + j``. So
``delta = logical - stored`` (0 for the prompt's own tokens; may be negative or > 65,536).
The same physical page may appear in several requests with different deltas, and twice in
one request. Entries at index >= ``count[b]`` are ignored. Rows past a page's ``length``
must hold finite values (the kernels read whole pages and give those rows weight 0, and
0 x NaN is NaN); the engine's pool starts zeroed.

Causal rule: a query at logical position ``m`` sees every valid key of its request whose
logical position is ``<= m``. Rows that see no key return 0.

API
---
``lazy_prefill(q, k_pages, v_pages, pages, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate=True)``
    q ``[total_q, num_heads, D]``: varlen-packed queries of B requests, request ``b`` owning
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (int32 [B+1]); ``q_pos`` int32 ``[total_q]``
    logical positions. Returns o ``[total_q, num_heads, D]`` in q's dtype.
    ``rotate=True``: q is UN-rotated; for each page the kernel uses ``R(m - delta) q`` against
    the stored keys, built from q only where the delta changes from one page to the next
    (the pages of a chunk share one); stored keys are never rotated or copied. ``rotate=False``: q is
    already rotated at its logical positions and keys are taken as being at logical
    positions (ordinary paged causal attention; the rotation is compiled out).
    GQA: ``num_heads`` must be a multiple of ``kv_heads`` (any ratio). The caller must have
    written the request's own new tokens into its own pages (delta 0) beforehand.
    When the grid would leave the GPU partly idle (few heads, short questions, small
    batches), each tile's pages are split across programs as in decode (one split rule).
``lazy_decode(q, k_pages, v_pages, pages, q_pos, inv_freq, sm_scale, rotate=True)``
    q ``[B, num_heads, D]``, one token per request at ``q_pos[b]`` (int32 [B]); same rules.
    Flash-decoding: each request's pages are split evenly across programs (whatever the
    table's width) and the parts merged by log-sum-exp; one program serves the query heads of
    one KV head, so each page is read once per group.
``rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=None, dst_v=None)``
    For each ``i``: page ``src[i]`` -> page ``dst[i]`` of ``dst_k``/``dst_v`` (default: the same
    pools, in place; then no dst page may also be a src page), keys re-rotated by
    ``R(delta[i])`` (stored at ``s + j`` -> rotated at ``s + delta + j``), values copied.
    ``src``, ``dst``, ``delta``: int32 [N]. Returns ``(dst_k, dst_v)``.

Both kernels walk a request's pages one page per key block, in one loop (see
docs/benchmarks.md for what each choice measured). Tuning (keyword-only, Triton path; the
reference ignores them): ``lazy_prefill`` takes ``max_seqlen_q`` (skips a host sync),
``block_m``, ``num_warps``, ``num_stages``, ``num_splits``, ``maxnreg`` (a register cap per
thread; 0 for none) and ``out``; ``lazy_decode`` takes ``num_splits``,
``block_h`` (query rows per program), ``tma`` (Hopper TMA page loads, needs contiguous pools;
off by default), ``num_warps``, ``num_stages`` and ``out``.
Measured on the H200: page size 64 is fastest (docs/benchmarks.md, "## Kernels").

Dispatch: CUDA tensors run the Triton kernels; CPU tensors run ``kernels.reference`` (plain
PyTorch), unless the environment variable ``TRITON_INTERPRET=1`` is set when the call is
made, in which case the Triton kernels run under the Triton interpreter on CPU (Triton itself
must then have been imported with TRITON_INTERPRET=1 set).
``kernels.reference`` exposes the PyTorch versions directly.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch
from torch import Tensor

from . import reference
from .pages import PageTable

__all__ = ["PageTable", "lazy_prefill", "lazy_decode", "rotate_copy", "reference", "backend"]

_TRITON_MODULES: dict[bool, object] = {}


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _triton_module(interpret: bool):
    """The Triton kernel module, compiled (``interpret=False``) or under the interpreter.

    Triton decides interpreted vs compiled when ``@triton.jit`` runs, so the module is loaded
    once per mode under its own name, whatever TRITON_INTERPRET was at import time.
    """
    mod = _TRITON_MODULES.get(interpret)
    if mod is not None:
        return mod
    import triton  # noqa: F401  (ImportError surfaces here if Triton is missing)
    import triton.language.standard as tls
    from triton import knobs

    if interpret and type(tls.cdiv).__name__ != "InterpretedFunction":
        raise RuntimeError("the Triton interpreter needs TRITON_INTERPRET=1 set before triton is first imported")

    if interpret:
        _fix_interpreter_index()
    name = f"{__name__}._triton_{'interp' if interpret else 'jit'}"
    path = os.path.join(os.path.dirname(__file__), "_triton.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = __name__
    sys.modules[name] = mod
    old = knobs.runtime.interpret
    knobs.runtime.interpret = interpret
    try:
        spec.loader.exec_module(mod)
    finally:
        knobs.runtime.interpret = old
    _TRITON_MODULES[interpret] = mod
    return mod


def _fix_interpreter_index() -> None:
    """Let the Triton interpreter use scalar tensors as ``range`` bounds under NumPy 2.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy >= 2.x refuses for 1-D arrays (a loop ``for i in range(lo, hi)`` over loaded
    bounds then fails). Interpreter-only; compiled kernels are unaffected.
    """
    from triton.runtime import interpreter as _interp

    orig = _interp._patch_lang_tensor
    if getattr(orig, "_lazyrag_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lazyrag_fixed = True
    _interp._patch_lang_tensor = patched


_cpu = {"backend": "reference"}


@contextlib.contextmanager
def cpu_backend(name: str):
    """Run calls on CPU tensors with 'reference' (the default) or 'triton' (the Triton interpreter,
    which needs TRITON_INTERPRET=1 set before triton is first imported)."""
    if name not in ("reference", "triton"):
        raise ValueError(f"cpu backend must be 'reference' or 'triton', got {name!r}")
    old, _cpu["backend"] = _cpu["backend"], name
    try:
        yield
    finally:
        _cpu["backend"] = old


def backend(t: Tensor) -> str:
    """Which implementation a call on tensor ``t`` uses: 'triton', 'triton-interpret' or 'reference'."""
    if t.is_cuda:
        return "triton"
    return "triton-interpret" if _cpu["backend"] == "triton" else "reference"


def _impl(t: Tensor):
    kind = backend(t)
    if kind == "reference":
        return reference
    return _triton_module(kind == "triton-interpret")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_pool(k_pages: Tensor, v_pages: Tensor, D: int) -> None:
    if D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {D}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4 or t.shape[-1] != D:
            raise ValueError(f"{name} must be [num_pages, page_size, kv_heads, {D}], got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype must be fp16, bf16 or fp32, got {t.dtype}")
        ps, hkv = t.shape[1], t.shape[2]
        if ps < 16 or ps > 128 or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two in 16..128, got {ps}")
        if t.stride()[1:] != (hkv * D, D, 1):
            raise ValueError(f"{name} must be contiguous in its last three dims, strides {t.stride()}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} differ")


def _check_attn(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, inv_freq: Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D, got {tuple(q.shape)}")
    D = q.shape[-1]
    _check_pool(k_pages, v_pages, D)
    if q.dtype not in _DTYPES or q.dtype != k_pages.dtype or q.dtype != v_pages.dtype:
        raise ValueError(f"q, k_pages, v_pages must share one dtype in fp16/bf16/fp32: "
                         f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    H, Hkv = q.shape[1], k_pages.shape[2]
    if H % Hkv:
        raise ValueError(f"num_heads {H} must be a multiple of kv_heads {Hkv}")
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be float32 [{D // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    pages.validate()


def lazy_prefill(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, cu_seqlens_q: Tensor,
                 q_pos: Tensor, inv_freq: Tensor, sm_scale: float, rotate: bool = True, **tuning) -> Tensor:
    """Varlen prefill over paged KV with deferred RoPE; see the module docstring."""
    _check_attn(q, k_pages, v_pages, pages, inv_freq)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (pages.batch + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [B+1] = [{pages.batch + 1}]")
    if q_pos.dtype != torch.int32 or q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be int32 [total_q] = [{q.shape[0]}]")
    return _impl(q).lazy_prefill(q, k_pages, v_pages, pages, cu_seqlens_q, q_pos, inv_freq, sm_scale, rotate,
                                 **tuning)


def lazy_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, pages: PageTable, q_pos: Tensor,
                inv_freq: Tensor, sm_scale: float, rotate: bool = True, **tuning) -> Tensor:
    """One query token per request over paged KV (flash-decoding); see the module docstring."""
    _check_attn(q, k_pages, v_pages, pages, inv_freq)
    if q.shape[0] != pages.batch:
        raise ValueError(f"q has {q.shape[0]} requests, the page table {pages.batch}")
    if q_pos.dtype != torch.int32 or q_pos.shape != (q.shape[0],):
        raise ValueError(f"q_pos must be int32 [B] = [{q.shape[0]}]")
    return _impl(q).lazy_decode(q, k_pages, v_pages, pages, q_pos, inv_freq, sm_scale, rotate, **tuning)


def rotate_copy(k_pages: Tensor, v_pages: Tensor, src: Tensor, dst: Tensor, delta: Tensor, inv_freq: Tensor,
                dst_k: Tensor | None = None, dst_v: Tensor | None = None):
    """Copy pages ``src[i] -> dst[i]`` with keys re-rotated by ``delta[i]``; see the module docstring."""
    D = k_pages.shape[-1]
    _check_pool(k_pages, v_pages, D)
    dk = k_pages if dst_k is None else dst_k
    dv = v_pages if dst_v is None else dst_v
    _check_pool(dk, dv, D)
    if dk.shape[1:] != k_pages.shape[1:]:
        raise ValueError(f"destination page shape {tuple(dk.shape[1:])} != source {tuple(k_pages.shape[1:])}")
    for name, t in (("src", src), ("dst", dst), ("delta", delta)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != src.shape[0]:
            raise ValueError(f"{name} must be int32 [N]")
    if inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be float32 [{D // 2}]")
    return _impl(k_pages).rotate_copy(k_pages, v_pages, src, dst, delta, inv_freq, dst_k=dk, dst_v=dv)
