"""The compiled Triton kernels on a CUDA GPU against the PyTorch reference, at realistic sizes
and with every launch variant the kernels offer. Run on the device machine with `pytest -m gpu`."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import gpu_case, inv_freq_for, rel_err, to_cuda, tol

from lazyrag import kernels
from lazyrag.kernels import reference

pytestmark = pytest.mark.gpu

GPU_CASES = [(torch.bfloat16, 32, 8, 128, 16), (torch.bfloat16, 32, 8, 128, 64), (torch.bfloat16, 9, 3, 64, 32),
             (torch.bfloat16, 24, 8, 128, 64), (torch.float16, 32, 8, 128, 16), (torch.float16, 8, 8, 64, 16)]


# the defaults and every alternative the kernels still offer
PREFILL_VARIANTS = [dict(), dict(block_m=128), dict(num_splits=3), dict(num_stages=2, maxnreg=0)]
DECODE_VARIANTS = [dict(), dict(tma=True), dict(num_splits=5)]


@pytest.mark.parametrize("dtype,H,Hkv,D,PS", GPU_CASES)
def test_gpu_prefill_decode(monkeypatch, dtype, H, Hkv, D, PS):
    from lazyrag.kernels import splits

    monkeypatch.setattr(splits, "POISON_SCRATCH", True)
    base = 70000 if PS == 64 else 0
    c = to_cuda(gpu_case(100 + PS + H, H, Hkv, D, PS, n_req=3, q_len=77, chunk_len=500, n_chunks=6, base=base), dtype)
    for rotate in (True, False):
        want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq,
                                      c.sm_scale, rotate=rotate)
        for cfg in PREFILL_VARIANTS:
            got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq,
                                       c.sm_scale, rotate=rotate, out=torch.full_like(c.q, float("nan")), **cfg)
            torch.cuda.synchronize()
            assert not torch.isnan(got).any(), cfg
            assert rel_err(got, want) < tol(dtype), (cfg, rotate, rel_err(got, want))
        # decode: last token of each request
        last = (c.cu[1:] - 1).long()
        qd = c.q[last].contiguous()
        pd = c.q_pos[last].contiguous()
        want = reference.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale, rotate=rotate)
        for cfg in DECODE_VARIANTS:
            got = kernels.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale,
                                      rotate=rotate, out=torch.full_like(qd, float("nan")), **cfg)
            torch.cuda.synchronize()
            assert not torch.isnan(got).any(), cfg
            assert rel_err(got, want) < tol(dtype), (cfg, rotate, rel_err(got, want))


@pytest.mark.parametrize("dtype,H,Hkv,D,PS", GPU_CASES[1:3])
def test_gpu_ape(monkeypatch, dtype, H, Hkv, D, PS):
    """APE's temperature and scale on a run of each request's entries (a middle run, every
    entry, none), compiled, in every launch variant."""
    from lazyrag.kernels import splits

    monkeypatch.setattr(splits, "POISON_SCRATCH", True)
    runs = [(2, 3 * 500 // PS), (0, 10_000), (5, 5)]
    c = to_cuda(gpu_case(200 + PS, H, Hkv, D, PS, n_req=3, q_len=77, chunk_len=500, n_chunks=6, ape_runs=runs),
                dtype)
    last = (c.cu[1:] - 1).long()
    qd, pd = c.q[last].contiguous(), c.q_pos[last].contiguous()
    for rotate, ape in ((True, dict(ape_temperature=0.8, ape_scale=1.7)), (False, dict(ape_temperature=1.25))):
        want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                      rotate=rotate, **ape)
        for cfg in PREFILL_VARIANTS:
            got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                       rotate=rotate, out=torch.full_like(c.q, float("nan")), **ape, **cfg)
            torch.cuda.synchronize()
            assert not torch.isnan(got).any(), cfg
            assert rel_err(got, want) < tol(dtype), (cfg, rotate, rel_err(got, want))
        want = reference.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale, rotate=rotate,
                                     **ape)
        for cfg in DECODE_VARIANTS:
            got = kernels.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale, rotate=rotate,
                                      out=torch.full_like(qd, float("nan")), **ape, **cfg)
            torch.cuda.synchronize()
            assert not torch.isnan(got).any(), cfg
            assert rel_err(got, want) < tol(dtype), (cfg, rotate, rel_err(got, want))


@pytest.mark.parametrize("first,then", [(1, 3), (3, 1)])
def test_gpu_prefill_split_twin_compiled_with_first_launch(monkeypatch, first, then):
    """A prefill launch compiles its split (or unsplit) twin too: a serving run that meets the
    other variant later must not stall on a compile. The launch configurations (4 and 5
    stages) are ones no other test uses, so only this feature can have compiled the twin."""
    import triton

    compiled = []
    c = to_cuda(gpu_case(5, 8, 2, 64, 64, n_req=2, q_len=9, chunk_len=200, n_chunks=3), torch.float16)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
    stages = {1: 4, 3: 5}[first]  # a distinct configuration per parameter set
    kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                         num_stages=stages, num_splits=first)
    assert sum("_prefill_kernel" in r for r in compiled) == 2, compiled  # the launch and its twin
    compiled.clear()
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               num_stages=stages, num_splits=then)
    torch.cuda.synchronize()
    assert not any("_prefill_kernel" in r for r in compiled), compiled
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < tol(torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rotate_copy(dtype):
    g = torch.Generator().manual_seed(7)
    P, PS, Hkv, D = 300, 16, 8, 128
    kp = torch.randn(P, PS, Hkv, D, generator=g).to("cuda", dtype)
    vp = torch.randn(P, PS, Hkv, D, generator=g).to("cuda", dtype)
    inv = inv_freq_for(D).cuda()
    src = torch.randperm(P, generator=g)[:200].to(torch.int32).cuda()
    dst = torch.randperm(256, generator=g)[:200].to(torch.int32).cuda()
    dl = torch.randint(-100, 100000, (200,), generator=g, dtype=torch.int32).cuda()
    dk = torch.full((256, PS, Hkv, D), float("nan"), dtype=dtype, device="cuda")
    dv = dk.clone()
    rk, rv = dk.clone(), dv.clone()
    kernels.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=dk, dst_v=dv)
    reference.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=rk, dst_v=rv)
    d = dst.long()
    assert not torch.isnan(dk[d]).any()
    assert rel_err(dk[d], rk[d]) < tol(dtype)
    assert torch.equal(dv[d], rv[d])
    if dtype == torch.float32:
        # compiled kernels take cos/sin from range-reduced hardware approximations (rotation.py),
        # within 1e-6 of the precise values at these angles (deltas up to 1e5): a key pair of
        # norm <= 8 moves by under 1e-5 (without the reduction the error would be ~1e-1)
        assert (dk[d] - rk[d]).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, (8, 128)), (kernels.FP8, (8, 128)), (torch.float32, (8,)),
                                        (torch.float16, (3, 64))])
def test_gpu_rows_to_pages(dtype, unit):
    """An 8B chunk of 2,048 tokens (and odd shapes) into scattered pages of 64, as the loader writes them."""
    g = torch.Generator().manual_seed(8)
    layers, page_size, n = 32, 64, 32
    bits = torch.randint(0, 0x7E, (n * page_size, layers, 2, *unit), dtype=torch.uint8, generator=g)
    rows = (bits.view(dtype) if dtype == kernels.FP8 else bits.to(dtype)).cuda()
    pages = torch.randperm(300, generator=g)[:n].cuda()
    pool = torch.zeros(2, layers, 300, page_size, *unit, dtype=dtype, device="cuda")
    want = pool.clone()
    kernels.rows_to_pages(rows, pool, pages)
    reference.rows_to_pages(rows, want, pages)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))


def test_gpu_backend_is_compiled_triton():
    assert kernels.backend(torch.zeros(1, device="cuda")) == "triton"
