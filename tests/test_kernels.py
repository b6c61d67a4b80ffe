"""Tests for kernels/: Triton kernels (interpreter on CPU, compiled on CUDA) vs the PyTorch
reference, and the reference vs a float64 direct computation with explicit rotation/mask."""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# The Triton interpreter must be chosen before triton is first imported (its standard library
# is decorated at import). Without CUDA, import triton in interpreter mode here, then restore
# the variable so other test modules keep the reference dispatch on CPU.
if not HAS_CUDA and "triton" not in sys.modules:
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover
        pass
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old

try:
    import triton  # noqa: F401,F811
    import triton.language.standard as _tls
    HAS_TRITON = True
    TRITON_INTERPRETED = type(_tls.cdiv).__name__ == "InterpretedFunction"
except ImportError:  # pragma: no cover
    HAS_TRITON = False
    TRITON_INTERPRETED = False

from lazyrag import kernels  # noqa: E402
from lazyrag.kernels import PageTable, reference  # noqa: E402


# ----------------------------------------------------------------------------- case builder

@dataclass
class Case:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    pages: PageTable
    cu: torch.Tensor
    q_pos: torch.Tensor
    inv_freq: torch.Tensor
    sm_scale: float
    lens: list


def _inv_freq(D, base=10000.0, scale=1.0):
    return (1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)) / scale).to(torch.float32)


def _rope64(x, pos, inv_freq):
    """float64 rotation of x [..., D] by pos (broadcast to x[..., 0])."""
    half = x.shape[-1] // 2
    ang = pos.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def make_case(seed, *, H=4, Hkv=2, D=64, PS=16, dtype=torch.float32, device="cpu", n_req=3,
              chunk_lens=(37, 16, 50), preamble=0, q_lens=None, base_offsets=None, plan=None,
              random_qpos=False, spare_pages=3):
    """Random paged-KV case.

    Chunks are encoded position-free at stored positions preamble..preamble+L-1 (keys stored
    rotated there). Request ``r`` reads chunks ``plan[r]`` (indices, repeats allowed) laid out
    back to back from logical ``base_offsets[r]``, then its own ``q_lens[r]`` new tokens (own
    pages, delta 0), whose positions are the queries' positions.
    """
    g = torch.Generator().manual_seed(seed)
    if plan is None:
        plan = [[0, 1], [1, 0, 2], []][:n_req]
    n_req = len(plan)
    q_lens = q_lens or [5, 1, 13][:n_req]
    base_offsets = base_offsets or [0] * n_req
    # physical pages: chunks first
    chunk_pages = []
    nxt = 0
    for L in chunk_lens:
        np_ = math.ceil(L / PS)
        chunk_pages.append(list(range(nxt, nxt + np_)))
        nxt += np_
    own_pages = []
    for L in q_lens:
        np_ = math.ceil(L / PS)
        own_pages.append(list(range(nxt, nxt + np_)))
        nxt += np_
    num_pages = nxt + spare_pages
    inv_freq = _inv_freq(D, base=10000.0 + 17 * (seed % 7))
    # stored keys: raw keys rotated at stored positions (rows of padding get random junk too)
    k = torch.randn(num_pages, PS, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(num_pages, PS, Hkv, D, generator=g, dtype=torch.float64)
    for c, L in enumerate(chunk_lens):
        for pi, p in enumerate(chunk_pages[c]):
            pos = torch.arange(preamble + pi * PS, preamble + pi * PS + PS)
            k[p] = _rope64(k[p], pos[:, None].expand(PS, Hkv), inv_freq)
    rows = []
    qpos_all = []
    for r in range(n_req):
        ents = []
        s = base_offsets[r]
        for c in plan[r]:
            L = chunk_lens[c]
            for pi, p in enumerate(chunk_pages[c]):
                ents.append((p, s - preamble, preamble + pi * PS, min(PS, L - pi * PS)))
            s += L
        # own tokens at logical positions s..s+q_len-1, stored rotated there, delta 0
        Lq = q_lens[r]
        for pi, p in enumerate(own_pages[r]):
            st = s + pi * PS
            pos = torch.arange(st, st + PS)
            k[p] = _rope64(k[p], pos[:, None].expand(PS, Hkv), inv_freq)
            ents.append((p, 0, st, min(PS, Lq - pi * PS)))
        if random_qpos:
            qp = torch.randint(-5, s + Lq + 5, (Lq,), generator=g)
        else:
            qp = torch.arange(s, s + Lq)
        qpos_all.append(qp)
        rows.append(ents)
    maxp = max(1, max(len(e) for e in rows)) + 2  # extra junk entries past count
    ids = torch.randint(0, num_pages, (n_req, maxp), generator=g, dtype=torch.int32)
    delta = torch.randint(-1000, 1000, (n_req, maxp), generator=g, dtype=torch.int32)
    start = torch.randint(0, 1000, (n_req, maxp), generator=g, dtype=torch.int32)
    length = torch.randint(1, PS + 1, (n_req, maxp), generator=g, dtype=torch.int32)
    count = torch.zeros(n_req, dtype=torch.int32)
    for r, ents in enumerate(rows):
        count[r] = len(ents)
        for e, (p, d, st, ln) in enumerate(ents):
            ids[r, e], delta[r, e], start[r, e], length[r, e] = p, d, st, ln
    total = sum(q_lens)
    q = torch.randn(total, H, D, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q_pos = torch.cat(qpos_all).to(torch.int32)
    pt = PageTable(ids, delta, start, length, count).to(device)
    return Case(q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device), pt, cu.to(device),
                q_pos.to(device), inv_freq.to(device), 1.0 / math.sqrt(D), list(q_lens))


def direct64(c: Case, rotate=True):
    """Dense float64 attention: keys explicitly rotated to their logical positions, explicit mask."""
    PS, Hkv, D = c.k_pages.shape[1:]
    H = c.q.shape[1]
    G = H // Hkv
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    kp = c.k_pages.cpu().double()
    vp = c.v_pages.cpu().double()
    pt = c.pages.to("cpu")
    cu = c.cu.cpu().tolist()
    for b in range(len(cu) - 1):
        keys, vals, kpos = [], [], []
        for e in range(int(pt.count[b])):
            p, d, st, ln = (int(pt.ids[b, e]), int(pt.delta[b, e]), int(pt.start[b, e]), int(pt.length[b, e]))
            for j in range(ln):
                kk = kp[p, j]  # [Hkv, D], rotated at stored position st+j
                if rotate:
                    raw = _rope64(kk, torch.full((Hkv,), -(st + j)), c.inv_freq)
                    kk = _rope64(raw, torch.full((Hkv,), st + d + j), c.inv_freq)
                keys.append(kk)
                vals.append(vp[p, j])
                kpos.append(st + d + j)
        for t in range(cu[b], cu[b + 1]):
            m = int(c.q_pos[t])
            qt = c.q[t].cpu().double()
            if rotate:
                qt = _rope64(qt, torch.full((H,), m), c.inv_freq)
            if not keys:
                continue
            K = torch.stack(keys)  # [N, Hkv, D]
            V = torch.stack(vals)
            mask = torch.tensor(kpos) <= m
            if not mask.any():
                continue
            for h in range(H):
                sc = (K[:, h // G] @ qt[h]) * c.sm_scale
                sc = sc.masked_fill(~mask, float("-inf"))
                out[t, h] = torch.softmax(sc, 0) @ V[:, h // G]
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]


# ------------------------------------------------------------------ reference vs float64

REF_CASES = [
    dict(seed=1),
    dict(seed=2, H=3, Hkv=1, PS=32, preamble=40),  # negative deltas, GQA 3
    dict(seed=3, H=8, Hkv=1, D=128, base_offsets=[70000, 65537, 0]),  # deltas > 65536, GQA 8
    dict(seed=4, H=4, Hkv=4, random_qpos=True),  # MHA, some rows see nothing
    dict(seed=5, plan=[[2, 2], [0]], q_lens=[1, 7], PS=64),  # same page twice; one-token query
]


@pytest.mark.parametrize("kw", REF_CASES)
@pytest.mark.parametrize("rotate", [True, False])
def test_reference_vs_float64(kw, rotate):
    c = make_case(dtype=torch.float32, **kw)
    want = direct64(c, rotate=rotate)
    got = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                 rotate=rotate)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 2e-5
    # rows that see no key are exactly zero
    zero_rows = want.abs().sum(dim=(1, 2)) == 0
    assert (got[zero_rows] == 0).all()


def test_reference_decode_and_rotate_copy_vs_float64():
    c = make_case(seed=11, H=4, Hkv=2, q_lens=[1, 1, 1], base_offsets=[3, 80000, 0])
    want = direct64(c)
    got = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    assert rel_err(got, want) < 2e-5
    # rotate_copy: R(delta) applied to keys stored at s+j == keys rotated at s+delta+j
    g = torch.Generator().manual_seed(12)
    PS, Hkv, D = 16, 2, 64
    inv = _inv_freq(D)
    raw = torch.randn(4, PS, Hkv, D, generator=g, dtype=torch.float64)
    st = torch.tensor([0, 16, 100, 5])
    pos = st[:, None] + torch.arange(PS)
    kp = _rope64(raw, pos[:, :, None].expand(4, PS, Hkv), inv).float()
    vp = torch.randn(4, PS, Hkv, D, generator=g)
    dk, dv = torch.full((3, PS, Hkv, D), float("nan")), torch.full((3, PS, Hkv, D), float("nan"))
    src = torch.tensor([2, 0, 3], dtype=torch.int32)
    dst = torch.tensor([0, 2, 1], dtype=torch.int32)
    dl = torch.tensor([7, -16, 70000], dtype=torch.int32)
    reference.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=dk, dst_v=dv)
    for i in range(3):
        s, d_, t = int(src[i]), int(dst[i]), int(dl[i])
        want_k = _rope64(raw[s], (pos[s] + t)[:, None].expand(PS, Hkv), inv)
        # fp32 angle delta*inv_freq at 70,000 carries ~4e-3 rad of rounding; allow for it
        assert rel_err(dk[d_], want_k) < (1e-2 if abs(t) > 65536 else 1e-5)
        assert torch.equal(dv[d_], vp[s])


def test_bad_head_dim_and_shapes():
    c = make_case(seed=13)
    q = torch.randn(c.q.shape[0], c.q.shape[1], 96)
    kp = torch.randn(4, 16, 2, 96)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.lazy_prefill(q, kp, kp, c.pages, c.cu, c.q_pos, torch.ones(48), 0.1)
    with pytest.raises(ValueError, match="page_size"):
        kp = torch.randn(4, 24, 2, 64)
        kernels.lazy_prefill(c.q, kp, kp, c.pages, c.cu, c.q_pos, c.inv_freq, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        kp = torch.randn(4, 16, 3, 64)
        kernels.lazy_prefill(c.q, kp, kp, c.pages, c.cu, c.q_pos, c.inv_freq, 0.1)


def test_dispatch_cpu_default_is_reference():
    assert kernels.backend(torch.zeros(1)) == "reference"
    with kernels.cpu_backend("triton"):
        assert kernels.backend(torch.zeros(1)) == "triton-interpret"
    assert kernels.backend(torch.zeros(1)) == "reference"


# ------------------------------------------------- Triton (interpreter on CPU) vs reference

@pytest.fixture
def interp(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    if not TRITON_INTERPRETED:
        if torch.cuda.is_available():  # compiled Triton: the GPU tests cover the kernels
            pytest.skip("triton was imported compiled (CUDA present): interpreter tests skipped")
        # on a CPU machine these tests are the kernels' only check: never skip them silently
        pytest.fail("triton was imported before tests/test_kernels.py without TRITON_INTERPRET=1")
    mod = kernels._triton_module(True)
    monkeypatch.setattr(mod, "POISON_SCRATCH", True)
    with kernels.cpu_backend("triton"):
        yield mod


KERNEL_CASES = [
    # (id, kwargs)
    ("gqa2_ps16_f32", dict(seed=21, H=4, Hkv=2, dtype=torch.float32)),
    ("gqa3_neg_delta_f16", dict(seed=22, H=6, Hkv=2, dtype=torch.float16, preamble=40, PS=32)),
    ("gqa4_big_delta_f16", dict(seed=23, H=4, Hkv=1, D=128, dtype=torch.float16,
                                base_offsets=[70001, 0, 65600])),
    ("gqa8_f32", dict(seed=24, H=8, Hkv=1, dtype=torch.float32, q_lens=[3, 20, 1])),
    ("mha_randpos_f16", dict(seed=25, H=2, Hkv=2, dtype=torch.float16, random_qpos=True)),
    ("dup_page_ps64_f32", dict(seed=26, H=3, Hkv=1, PS=64, dtype=torch.float32,
                               plan=[[2, 2, 0], [1]], q_lens=[9, 1])),
    ("noncached_only_f16", dict(seed=27, H=4, Hkv=2, dtype=torch.float16, plan=[[], []], q_lens=[17, 1])),
    ("mixed_delta_block_f32", dict(seed=28, H=4, Hkv=2, PS=16, dtype=torch.float32,
                                   chunk_lens=(20, 9, 33), plan=[[0, 1, 2, 1]], q_lens=[4])),
]


@pytest.mark.parametrize("name,kw", KERNEL_CASES, ids=[k[0] for k in KERNEL_CASES])
@pytest.mark.parametrize("rotate", [True, False])
def test_prefill_interp(interp, name, kw, rotate):
    check_prefill(make_case(**kw), rotate=rotate)


def check_prefill(c: Case, **opts):
    """The kernel into a NaN-poisoned output against the reference: every element written, close."""
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=opts.get("rotate", True))
    out = torch.full_like(c.q, float("nan"))
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               out=out, **opts)
    assert got is out
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("name,kw", [KERNEL_CASES[i] for i in (0, 2, 5, 7)],
                         ids=[KERNEL_CASES[i][0] for i in (0, 2, 5, 7)])
def test_prefill_interp_wide_tile(interp, name, kw):
    """64-row tiles: one tile holds many query rows (and tokens of several pages)."""
    check_prefill(make_case(**kw), block_m=64)


@pytest.mark.parametrize("name,kw", KERNEL_CASES, ids=[k[0] for k in KERNEL_CASES])
@pytest.mark.parametrize("splits", [2, 5])
def test_prefill_interp_splits(interp, name, kw, splits):
    """Each tile's pages split across programs and merged: splits past the page count (empty
    splits) and splits where a row sees no unmasked key included."""
    check_prefill(make_case(**kw), num_splits=splits)


@pytest.mark.parametrize("name,kw", KERNEL_CASES[:6], ids=[k[0] for k in KERNEL_CASES[:6]])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_interp(interp, name, kw, splits):
    kw = dict(kw)
    n = len(kw.get("plan") or [0, 1, 2])
    kw["q_lens"] = [1] * n
    kw.pop("random_qpos", None)
    c = make_case(**kw)
    for rotate in (True, False):
        want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                     rotate=rotate)
        out = torch.full_like(c.q, float("nan"))
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                                  rotate=rotate, out=out, num_splits=splits)
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


@pytest.mark.parametrize("D", [64, 128])
def test_decode_interp_wide_table(interp, D):
    """As a CUDA graph runs it: a page table far wider than any request (junk past each count),
    the split over each request's own pages."""
    c = make_case(seed=43, H=4, Hkv=2, D=D, dtype=torch.float16, q_lens=[1, 1, 1])
    g = torch.Generator().manual_seed(44)
    wide = 5 * c.pages.max_pages

    def widen(t, hi):
        out = torch.randint(0, hi, (t.shape[0], wide), generator=g, dtype=torch.int32)
        out[:, : t.shape[1]] = t
        return out

    n_pages = c.k_pages.shape[0]
    pages = PageTable(widen(c.pages.ids, n_pages), widen(c.pages.delta, 999), widen(c.pages.start, 999),
                      widen(c.pages.length, c.k_pages.shape[1]), c.pages.count)
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, pages, c.q_pos, c.inv_freq, c.sm_scale,
                              num_splits=4, out=torch.full_like(c.q, float("nan")))
    assert not torch.isnan(got).any(), "unwritten output elements"
    assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)


def test_split_rule(interp):
    """The split count follows waves of resident programs. Decode at 3 programs per SM on 132
    SMs: 3 splits for 32 requests x 8 KV heads (2 full waves) and 6 for 8 x 8 (1 wave), the
    counts measured best on the H200. Prefill at 2 per SM: Llama-8B's 8 x 2 tiles x 32 heads
    fill the GPU unsplit; SmolLM2's 9 heads leave it partly idle, so they are split. Never
    more splits than pages, never more than 64."""
    splits = kernels._triton_module(True)._num_splits
    slots = 3 * 132
    assert splits(32 * 8, 128, slots) == 3
    assert splits(8 * 8, 512, slots) == 6
    assert splits(1 * 8, 2048, slots) == 49  # one short request: spread it over the GPU
    assert splits(8, 5, slots) == 5 and splits(8, 0, slots) == 1
    assert all(1 <= splits(p, n, slots) <= 64 for p in (1, 7, 256, 4096) for n in (1, 100, 10_000))
    assert splits(32 * 8 * 2, 130, 2 * 132) == 1
    assert splits(9 * 8 * 2, 130, 2 * 132) > 1


def test_empty_request_interp(interp):
    """A request with no pages at all (count 0) gets zeros; the others are unaffected."""
    c = make_case(seed=41, H=4, Hkv=2, dtype=torch.float16)
    c.pages.count[1] = 0
    want = reference.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_prefill(c.q, c.k_pages, c.v_pages, c.pages, c.cu, c.q_pos, c.inv_freq, c.sm_scale,
                               out=torch.full_like(c.q, float("nan")))
    assert (got[c.cu[1]:c.cu[2]] == 0).all() and (want[c.cu[1]:c.cu[2]] == 0).all()
    assert rel_err(got, want) < tol(c.q.dtype)
    c = make_case(seed=42, H=4, Hkv=2, dtype=torch.float16, q_lens=[1, 1, 1])
    c.pages.count[0] = 0
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale)
    got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale,
                              out=torch.full_like(c.q, float("nan")))
    assert (got[0] == 0).all() and not torch.isnan(got).any()
    assert rel_err(got, want) < tol(c.q.dtype)


@pytest.mark.parametrize("dtype,PS,Hkv,D", [(torch.float32, 16, 2, 64), (torch.float16, 32, 3, 128),
                                            (torch.float16, 16, 1, 64)])
def test_rotate_copy_interp(interp, dtype, PS, Hkv, D):
    g = torch.Generator().manual_seed(31 + PS + D)
    P = 9
    kp = torch.randn(P, PS, Hkv, D, generator=g).to(dtype)
    vp = torch.randn(P, PS, Hkv, D, generator=g).to(dtype)
    inv = _inv_freq(D)
    src = torch.tensor([1, 4, 4, 0], dtype=torch.int32)
    dst = torch.tensor([5, 6, 2, 8], dtype=torch.int32)
    dl = torch.tensor([3, -70, 70000, 0], dtype=torch.int32)
    # separate destination pools, poisoned
    dk = torch.full((10, PS, Hkv, D), float("nan"), dtype=dtype)
    dv = torch.full((10, PS, Hkv, D), float("nan"), dtype=dtype)
    rk, rv = dk.clone(), dv.clone()
    reference.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=rk, dst_v=rv)
    kernels.rotate_copy(kp, vp, src, dst, dl, inv, dst_k=dk, dst_v=dv)
    d = dst.long()
    assert not torch.isnan(dk[d]).any() and not torch.isnan(dv[d]).any()
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[d] = False
    assert torch.isnan(dk[untouched]).all() and torch.isnan(dv[untouched]).all()
    assert rel_err(dk[d], rk[d]) < tol(dtype)
    assert torch.equal(dv[d], rv[d])
    # in place (default pools): dst pages disjoint from src pages
    kp2, vp2 = kp.clone(), vp.clone()
    kr, vr = kp.clone(), vp.clone()
    src2 = torch.tensor([1, 4], dtype=torch.int32)
    dst2 = torch.tensor([7, 3], dtype=torch.int32)
    dl2 = torch.tensor([12, 99999], dtype=torch.int32)
    kernels.rotate_copy(kp2, vp2, src2, dst2, dl2, inv)
    reference.rotate_copy(kr, vr, src2, dst2, dl2, inv)
    assert rel_err(kp2, kr) < tol(dtype) and torch.equal(vp2, vr)


# ------------------------------------------------------------------------------ GPU tests

def _gpu_case(seed, H, Hkv, D, PS, dtype, n_req, q_len, chunk_len, n_chunks, base=0):
    """Realistic: n_chunks chunks of chunk_len shared across requests in different orders."""
    g = torch.Generator().manual_seed(seed)
    plan = [torch.randperm(n_chunks, generator=g).tolist() for _ in range(n_req)]
    return make_case(seed, H=H, Hkv=Hkv, D=D, PS=PS, dtype=torch.float32, chunk_lens=[chunk_len] * n_chunks,
                     plan=plan, q_lens=[q_len] * n_req, base_offsets=[base + 1000 * r for r in range(n_req)],
                     preamble=7, spare_pages=0)


def _to(c: Case, dtype):
    return Case(c.q.to("cuda", dtype), c.k_pages.to("cuda", dtype), c.v_pages.to("cuda", dtype), c.pages.to("cuda"),
                c.cu.cuda(), c.q_pos.cuda(), c.inv_freq.cuda(), c.sm_scale, c.lens)


GPU_CASES = [(torch.bfloat16, 32, 8, 128, 16), (torch.bfloat16, 32, 8, 128, 64), (torch.bfloat16, 9, 3, 64, 32),
             (torch.bfloat16, 24, 8, 128, 64), (torch.float16, 32, 8, 128, 16), (torch.float16, 8, 8, 64, 16)]


# the defaults and every alternative the kernels still offer
PREFILL_VARIANTS = [dict(), dict(block_m=128), dict(num_splits=3), dict(num_stages=2, maxnreg=0)]
DECODE_VARIANTS = [dict(), dict(tma=True), dict(num_splits=5)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,H,Hkv,D,PS", GPU_CASES)
def test_gpu_prefill_decode(dtype, H, Hkv, D, PS):
    mod = kernels._triton_module(False)
    mod.POISON_SCRATCH = True
    try:
        base = 70000 if PS == 64 else 0
        c = _to(_gpu_case(100 + PS + H, H, Hkv, D, PS, torch.float32, n_req=3, q_len=77, chunk_len=500,
                          n_chunks=6, base=base), dtype)
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
            want = reference.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale,
                                         rotate=rotate)
            for cfg in DECODE_VARIANTS:
                got = kernels.lazy_decode(qd, c.k_pages, c.v_pages, c.pages, pd, c.inv_freq, c.sm_scale,
                                          rotate=rotate, out=torch.full_like(qd, float("nan")), **cfg)
                torch.cuda.synchronize()
                assert not torch.isnan(got).any(), cfg
                assert rel_err(got, want) < tol(dtype), (cfg, rotate, rel_err(got, want))
    finally:
        mod.POISON_SCRATCH = False


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("first,then", [(1, 3), (3, 1)])
def test_gpu_prefill_split_twin_compiled_with_first_launch(monkeypatch, first, then):
    """A prefill launch compiles its split (or unsplit) twin too: a serving run that meets the
    other variant later must not stall on a compile. The launch configurations (4 and 5
    stages) are ones no other test uses, so only this feature can have compiled the twin."""
    import triton as _triton

    compiled = []
    c = _to(_gpu_case(5, 8, 2, 64, 64, torch.float32, n_req=2, q_len=9, chunk_len=200, n_chunks=3), torch.float16)
    monkeypatch.setattr(_triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
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


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rotate_copy(dtype):
    g = torch.Generator().manual_seed(7)
    P, PS, Hkv, D = 300, 16, 8, 128
    kp = torch.randn(P, PS, Hkv, D, generator=g).to("cuda", dtype)
    vp = torch.randn(P, PS, Hkv, D, generator=g).to("cuda", dtype)
    inv = _inv_freq(D).cuda()
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
        # compiled kernels take cos/sin from range-reduced hardware approximations (_cos_sin),
        # within 1e-6 of the precise values at these angles (deltas up to 1e5): a key pair of
        # norm <= 8 moves by under 1e-5 (without the reduction the error would be ~1e-1)
        assert (dk[d] - rk[d]).abs().max().item() < 2e-5


@pytest.mark.parametrize("name,kw", [KERNEL_CASES[i] for i in (0, 2, 4, 5)],
                         ids=[KERNEL_CASES[i][0] for i in (0, 2, 4, 5)])
@pytest.mark.parametrize("rotate", [True, False])
def test_decode_interp_tma(interp, name, kw, rotate):
    """Decode pages loaded as whole TMA tiles, with 16 and 64 query rows per program."""
    kw = dict(kw, q_lens=[1] * len(kw.get("plan") or [0, 1, 2]))
    kw.pop("random_qpos", None)
    c = make_case(**kw)
    want = reference.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale, rotate=rotate)
    for block_h in (None, 64):
        got = kernels.lazy_decode(c.q, c.k_pages, c.v_pages, c.pages, c.q_pos, c.inv_freq, c.sm_scale, rotate=rotate,
                                  out=torch.full_like(c.q, float("nan")), tma=True, block_h=block_h, num_splits=2)
        assert not torch.isnan(got).any(), "unwritten output elements"
        assert rel_err(got, want) < tol(c.q.dtype), rel_err(got, want)
