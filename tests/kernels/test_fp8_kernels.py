"""fp8 pages: the per-row quantisation, the Triton kernels (interpreter) on e4m3 pages with their
scales against the reference on the dequantised pages, rotate_copy's requantisation, and the
argument rules."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import cuda_fp8, fp8_case, inv_freq_for, make_case, rel_err, rope64, tol

from lazyrag import kernels
from lazyrag.kernels import reference


def test_rows_keep_their_amax_at_448_and_come_back_within_e4m3_precision():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 3, 5)[:, None, None]
    x[2, 1] = 0
    values, scale = kernels.quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (5, 3)
    torch.testing.assert_close(scale, x.abs().amax(-1) / 448)
    amax = values.float().abs().amax(-1)
    assert torch.equal(amax[scale > 0], torch.full_like(amax[scale > 0], 448.0))
    assert scale[2, 1] == 0 and (values[2, 1].float() == 0).all()
    back = kernels.dequantize_fp8(values, scale)
    # 3 mantissa bits: each element within 2**-4 of itself, or of the row's smallest step
    err = (back - x).abs()
    assert (err <= x.abs() / 16 + scale[..., None] * 2**-9).all()


def test_reference_reads_fp8_pages_as_their_dequantised_values():
    c, ks, vs, plain = fp8_case(make_case(seed=3, H=6, Hkv=2, chunk_lens=(37, 16, 50), preamble=9))
    got = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                 k_scale=ks, v_scale=vs)
    want = reference.lazy_prefill(plain.q, plain.k_pages, plain.v_pages, plain.pages, plain.cu, plain.q_pos,
                                  plain.inv_freq, plain.sm_scale)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


PREFILL_CASES = [
    # odd chunk lengths, GQA 3, negative deltas; every request reads chunk 1 at another delta
    ("gqa3_f32", dict(seed=51, H=6, Hkv=2, preamble=40, PS=32, chunk_lens=(37, 19, 50),
                      plan=[[0, 1], [1, 0, 2], [2, 1]], q_lens=[5, 1, 13], base_offsets=[3, 70000, 0])),
    ("gqa4_d128_f16", dict(seed=52, H=4, Hkv=1, D=128, dtype=torch.float16, chunk_lens=(21, 33),
                           plan=[[1, 0, 1], [0]], q_lens=[7, 2])),
    ("mha_ps64_f16", dict(seed=53, H=2, Hkv=2, PS=64, dtype=torch.float16, random_qpos=True)),
]


@pytest.mark.parametrize("name,kw", PREFILL_CASES, ids=[k[0] for k in PREFILL_CASES])
@pytest.mark.parametrize("rotate,splits", [(True, None), (False, None), (True, 3)])
def test_prefill_on_fp8_pages_matches_the_reference_on_dequantised_pages(interp, name, kw, rotate, splits):
    c, ks, vs, plain = fp8_case(make_case(**kw))
    want = reference.lazy_prefill(plain.q, plain.k_pages, plain.v_pages, plain.pages, plain.cu, plain.q_pos,
                                  plain.inv_freq, plain.sm_scale, rotate=rotate)
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               rotate=rotate, k_scale=ks, v_scale=vs, num_splits=splits,
                               out=torch.full_like(c.q, float("nan")))
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("name,kw", PREFILL_CASES[:2], ids=[k[0] for k in PREFILL_CASES[:2]])
@pytest.mark.parametrize("tma", [False, True])
def test_decode_on_fp8_pages_matches_the_reference_on_dequantised_pages(interp, name, kw, tma):
    kw = dict(kw, q_lens=[1] * len(kw["plan"]))
    c, ks, vs, plain = fp8_case(make_case(**kw))
    for rotate in (True, False):
        want = reference.lazy_decode(plain.q, plain.k_pages, plain.v_pages, plain.pages, plain.q_pos,
                                     plain.inv_freq, plain.sm_scale, rotate=rotate)
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=rotate, k_scale=ks, v_scale=vs, num_splits=2, tma=tma,
                                  out=torch.full_like(c.q, float("nan")))
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("PS,Hkv,D", [(16, 3, 64), (32, 1, 128)])
def test_rotate_copy_requantises_rotated_keys_and_copies_values(interp, PS, Hkv, D):
    g = torch.Generator().manual_seed(PS + D)
    P, inv = 8, inv_freq_for(D)
    k8, ks = kernels.quantize_fp8(torch.randn(P, PS, Hkv, D, generator=g))
    v8, vs = kernels.quantize_fp8(torch.randn(P, PS, Hkv, D, generator=g))
    src = torch.tensor([1, 4, 0], dtype=torch.int32)
    dst = torch.tensor([5, 2, 7], dtype=torch.int32)
    delta = torch.tensor([3, -70, 70000], dtype=torch.int32)
    pools = [t.clone() for t in (k8, v8, ks, vs)]
    kernels.rotate_copy(*pools[:2], src, dst, delta, inv, k_scale=pools[2], v_scale=pools[3])
    want = [t.clone() for t in (k8, v8, ks, vs)]
    reference.rotate_copy(*want[:2], src, dst, delta, inv, k_scale=want[2], v_scale=want[3])
    d, s = dst.long(), src.long()
    got_k, want_k = (kernels.dequantize_fp8(p[0][d], p[2][d]) for p in (pools, want))
    assert rel_err(got_k, want_k) < 1e-5  # the interpreter's cos/sin are the reference's: the same e4m3 steps
    assert torch.equal(pools[1][d].view(torch.uint8), v8[s].view(torch.uint8)) and torch.equal(pools[3][d], vs[s])
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[d] = False
    assert torch.equal(pools[0][untouched].view(torch.uint8), k8[untouched].view(torch.uint8))
    # and the keys are the dequantised source rotated, within e4m3's precision
    exact = rope64(kernels.dequantize_fp8(k8[s], ks[s]).double(), delta.double()[:, None, None].expand(-1, PS, Hkv),
                   inv)
    assert all(rel_err(got_k[i], exact[i]) < 4e-2 for i in range(len(src)))


def test_fp8_pages_need_their_scales_and_other_pages_refuse_them():
    c, ks, vs, plain = fp8_case(make_case(seed=7))
    with pytest.raises(ValueError, match="need k_scale"):
        kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    with pytest.raises(ValueError, match="need v_scale"):
        kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, k_scale=ks,
                             v_scale=vs[:, :, :1])
    with pytest.raises(ValueError, match="go with float8_e4m3fn pages"):
        kernels.lazy_prefill(plain.q, plain.k_pages, plain.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq,
                             c.sm_scale, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.lazy_prefill(c.q, c.k_pages, plain.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                             k_scale=ks, v_scale=vs)
    src = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="must match"):
        kernels.rotate_copy(c.k_pages, c.v_pages, src, src + 1, src, c.inv_freq, dst_k=plain.k_pages,
                            dst_v=plain.v_pages, k_scale=ks, v_scale=vs)


def test_fp8_needs_compute_capability_8_9_on_a_gpu():
    assert kernels.fp8_supported(None)  # the CPU: the reference, or Triton's interpreter
    assert kernels.fp8_supported((8, 9)) and kernels.fp8_supported((9, 0))
    assert not kernels.fp8_supported((8, 0)) and not kernels.fp8_supported((7, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_fp8(), reason="needs a GPU of compute capability 8.9 or later")
@pytest.mark.parametrize("dtype,H,Hkv,D,PS", [(torch.bfloat16, 32, 8, 128, 64), (torch.bfloat16, 9, 3, 64, 32),
                                              (torch.float16, 8, 8, 64, 16)])
def test_gpu_fp8_pages_match_the_reference_on_dequantised_pages(dtype, H, Hkv, D, PS):
    """Compiled: prefill (split and not), decode (TMA and not) and rotate_copy on e4m3 pages."""
    from kernel_cases import gpu_case, to_cuda

    c = to_cuda(gpu_case(300 + PS + H, H, Hkv, D, PS, n_req=3, q_len=77, chunk_len=500, n_chunks=6), dtype)
    k8, ks = kernels.quantize_fp8(c.k_pages)
    v8, vs = kernels.quantize_fp8(c.v_pages)
    k, v = kernels.dequantize_fp8(k8, ks), kernels.dequantize_fp8(v8, vs)
    want = reference.lazy_prefill(c.q, k, v, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    for cfg in (dict(), dict(num_splits=3)):
        got = kernels.lazy_prefill(c.q, k8, v8, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale, k_scale=ks,
                                   v_scale=vs, **cfg)
        assert rel_err(got, want) < tol(dtype), (cfg, rel_err(got, want))
    last = (c.cu[1:] - 1).long()
    qd, pd = c.q[last].contiguous(), c.q_pos[last].contiguous()
    want = reference.lazy_decode(qd, k, v, c.pages, pd, c.inv_freq, c.sm_scale)
    for cfg in (dict(), dict(tma=True), dict(num_splits=5)):
        got = kernels.lazy_decode(qd, k8, v8, c.pages, pd, c.inv_freq, c.sm_scale, k_scale=ks, v_scale=vs, **cfg)
        assert rel_err(got, want) < tol(dtype), (cfg, rel_err(got, want))
    src = torch.tensor([1, 4, 0], dtype=torch.int32, device="cuda")
    dst = torch.tensor([7, 9, 11], dtype=torch.int32, device="cuda")
    delta = torch.tensor([3, -70, 70000], dtype=torch.int32, device="cuda")
    pools, ref = [t.clone() for t in (k8, v8, ks, vs)], [t.cpu() for t in (k8, v8, ks, vs)]
    kernels.rotate_copy(*pools[:2], src, dst, delta, c.inv_freq, k_scale=pools[2], v_scale=pools[3])
    reference.rotate_copy(*ref[:2], src.cpu(), dst.cpu(), delta.cpu(), c.inv_freq.cpu(), k_scale=ref[2],
                          v_scale=ref[3])
    d = dst.long().cpu()
    got_k = kernels.dequantize_fp8(pools[0][d.cuda()].cpu(), pools[2][d.cuda()].cpu())
    # the GPU's fast cos/sin may round a few values to the neighbouring e4m3 step
    assert rel_err(got_k, kernels.dequantize_fp8(ref[0][d], ref[2][d])) < 1e-2
    assert torch.equal(pools[1][d.cuda()].cpu().view(torch.uint8), ref[1][d].view(torch.uint8))
