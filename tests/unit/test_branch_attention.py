"""Branch attention and the LSE merge against dense masked softmax attention (fp64, CPU).

Covers: merge_lse (finite, one side −inf, both −inf; forward and backward NaN-free), attention_with_lse
(masks, causal, GQA, fully masked rows), splitting keys and merging = full attention, and
branch_attention for the EAGLE-3 diagonal (J = 1, 3 and step-at-a-time Gq < Gk) and DFlash/DSpark
blocks (γ = 2, 4), GQA and not, packed varlen with a padding tail, anchors at the first/last token of
each sequence and in the padding: O, LSE and the gradients of all five inputs.
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
from torch.testing import assert_close

from codraft.attention import (
    attention_with_lse,
    branch_attention,
    branch_attention_with_lse,
    dense_branch_reference,
    merge_lse,
)
from codraft.attention.branch import branch_main_mask, branch_main_part, dense_branch_mask

F64 = torch.float64
NEG_INF = float("-inf")


def _rand(*shape, gen, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()


def _grads(fn, inputs, gen):
    """Values of fn(*inputs) -> (O, LSE) and d(<O,gO> + <LSE,gL>)/d inputs with fixed random gO, gL."""
    o, lse = fn(*inputs)
    go = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    gl = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    loss = (o * go).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * gl).sum()
    return o, lse, torch.autograd.grad(loss, inputs)


# ---- merge_lse ------------------------------------------------------------------------------


def test_merge_matches_logaddexp():
    gen = torch.Generator().manual_seed(0)
    o1, o2 = _rand(2, 3, 5, 4, gen=gen), _rand(2, 3, 5, 4, gen=gen)
    l1, l2 = _rand(2, 3, 5, gen=gen), _rand(2, 3, 5, gen=gen)
    o, lse = merge_lse(o1, l1, o2, l2)
    ref_lse = torch.logaddexp(l1, l2)
    ref_o = torch.exp(l1 - ref_lse)[..., None] * o1 + torch.exp(l2 - ref_lse)[..., None] * o2
    assert_close(lse, ref_lse)
    assert_close(o, ref_o)
    g = torch.autograd.grad((o.sum() + lse.sum()), (o1, l1, o2, l2))
    g_ref = torch.autograd.grad((ref_o.sum() + ref_lse.sum()), (o1, l1, o2, l2))
    for a, b in zip(g, g_ref):
        assert_close(a, b)


def test_merge_large_lse_is_stable():
    o1, o2 = torch.ones(1, 4), torch.full((1, 4), 3.0)
    o, lse = merge_lse(o1, torch.tensor([1000.0]), o2, torch.tensor([1000.0]))
    assert_close(lse, torch.tensor([1000.0 + math.log(2.0)]))
    assert_close(o, torch.full((1, 4), 2.0))


@pytest.mark.parametrize("side", ["first", "second", "both"])
def test_merge_with_empty_parts(side):
    gen = torch.Generator().manual_seed(1)
    o1, o2 = _rand(2, 6, 3, gen=gen), _rand(2, 6, 3, gen=gen)
    l1 = torch.randn(2, 6, generator=gen, dtype=F64)
    l2 = torch.randn(2, 6, generator=gen, dtype=F64)
    if side in ("first", "both"):
        l1[:, ::2] = NEG_INF  # some rows empty on this side
        with torch.no_grad():
            o1[:, ::2] = 0.0
    if side in ("second", "both"):
        l2[:, ::2] = NEG_INF
        with torch.no_grad():
            o2[:, ::2] = 0.0
    l1.requires_grad_()
    l2.requires_grad_()
    o, lse = merge_lse(o1, l1, o2, l2)
    assert not o.isnan().any() and not lse.isnan().any()
    even, odd = slice(None, None, 2), slice(1, None, 2)
    if side == "first":
        assert_close(o[:, even], o2[:, even])
        assert_close(lse[:, even], l2[:, even])
    elif side == "second":
        assert_close(o[:, even], o1[:, even])
        assert_close(lse[:, even], l1[:, even])
    else:
        assert (o[:, even] == 0).all() and (lse[:, even] == NEG_INF).all()
    assert torch.isfinite(lse[:, odd]).all()
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64)).sum()
    loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).sum()
    grads = torch.autograd.grad(loss, (o1, l1, o2, l2))
    for g in grads:
        assert torch.isfinite(g).all()
    if side in ("first", "both"):  # an empty part gets no gradient
        assert (grads[0][:, even] == 0).all() and (grads[1][:, even] == 0).all()


# ---- attention_with_lse ---------------------------------------------------------------------


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2)])
def test_attention_with_lse_matches_sdpa(h, hkv):
    gen = torch.Generator().manual_seed(2)
    q, k, v = _rand(2, h, 5, 8, gen=gen), _rand(2, hkv, 7, 8, gen=gen), _rand(2, hkv, 7, 8, gen=gen)
    mask = torch.rand(2, 1, 5, 7, generator=gen) < 0.7
    mask[..., 0] = True
    for kwargs in ({"mask": mask}, {"causal": True}):
        o, lse = attention_with_lse(q, k, v, **kwargs)
        m = kwargs.get("mask")
        if m is None:
            m = torch.ones(5, 7, dtype=torch.bool).tril(7 - 5)
        ref_o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=h != hkv)
        scores = q @ k.repeat_interleave(h // hkv, 1).transpose(-1, -2) / math.sqrt(8)
        ref_lse = torch.logsumexp(scores.masked_fill(~m, NEG_INF), -1)
        assert_close(o, ref_o)
        assert_close(lse, ref_lse)


def test_attention_with_lse_fully_masked_rows():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _rand(1, 4, 3, 8, gen=gen), _rand(1, 2, 4, 8, gen=gen), _rand(1, 2, 4, 8, gen=gen)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    mask[:, :, 1] = False  # row 1 sees nothing
    o, lse = attention_with_lse(q, k, v, mask)
    assert (o[:, :, 1] == 0).all() and (lse[:, :, 1] == NEG_INF).all()
    assert torch.isfinite(o).all() and not lse.isnan().any()
    # downstream code merges the empty row with something finite, so lse gets gradient 0 there
    out, out_lse = merge_lse(o, lse, torch.zeros_like(o), torch.zeros_like(lse))
    dq, dk, dv = torch.autograd.grad(out.sum() + out_lse.sum(), (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert (dq[:, :, 1] == 0).all()


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2)])
def test_split_keys_then_merge_equals_full(h, hkv):
    """The ring's step: causal attention over [K1 ; K2] = merge(diagonal part, off-diagonal part)."""
    gen = torch.Generator().manual_seed(4)
    t = 6
    q, k, v = _rand(2, h, t, 8, gen=gen), _rand(2, hkv, 2 * t, 8, gen=gen), _rand(2, hkv, 2 * t, 8, gen=gen)

    def split(q, k, v):
        o1, l1 = attention_with_lse(q, k[:, :, :t], v[:, :, :t])  # earlier chunk: all visible
        o2, l2 = attention_with_lse(q, k[:, :, t:], v[:, :, t:], causal=True)  # own chunk
        return merge_lse(o1, l1, o2, l2)

    def full(q, k, v):
        return attention_with_lse(q, k, v, causal=True)

    o, lse, g = _grads(split, (q, k, v), torch.Generator().manual_seed(5))
    ro, rlse, rg = _grads(full, (q, k, v), torch.Generator().manual_seed(5))
    assert_close(o, ro)
    assert_close(lse, rlse)
    for a, b in zip(g, rg):
        assert_close(a, b)


# ---- masks ----------------------------------------------------------------------------------


def test_branch_main_mask_literal():
    cu = torch.tensor([0, 3, 5])  # sequences [0,3), [3,5); position 5 is padding
    anchors = torch.tensor([0, 2, 3, 4, 5])
    strict = branch_main_mask(anchors, 6, include_anchor=False, cu_seqlens=cu)[0].int()
    incl = branch_main_mask(anchors, 6, include_anchor=True, cu_seqlens=cu)[0].int()
    assert strict.tolist() == [
        [0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert incl.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0],
    ]


def test_dense_mask_matches_eagle3_and_dflash_formulas():
    t, j = 5, 3  # EAGLE-3 flex mask: causal (q ≥ kv) OR (kv ≥ T AND (kv − q) % T == 0), slot-major keys
    m = dense_branch_mask(None, t, t, j, j, local="diagonal", include_anchor=True)[0, 0]  # (T·J, T+T·J)
    for step, row in itertools.product(range(j), range(t)):
        kv = torch.arange(t + t * j)
        ref = (kv < t) & (kv <= row)
        ref |= (kv >= t) & ((kv - t) % t == row) & ((kv - t) // t <= step)  # key of step (kv-t)//t at row
        # our branch keys are branch-major (row, step); reorder the reference's step-major keys
        ref_branch = ref[t:].view(j, t).t().reshape(-1)
        assert torch.equal(m[row * j + step], torch.cat([ref[:t], ref_branch]))
    s, bs, anchors = 9, 3, torch.tensor([0, 4, 8])  # DFlash: ctx kv < anchor, draft: same block
    m = dense_branch_mask(anchors, s, 3, bs, bs, local="block", include_anchor=False)[0, 0]
    q = torch.arange(3 * bs)[:, None]
    kv = torch.arange(s + 3 * bs)[None, :]
    ref = ((kv < s) & (kv < anchors[q // bs])) | ((kv >= s) & ((kv - s) // bs == q // bs))
    assert torch.equal(m, ref)


# ---- branch attention vs dense reference ----------------------------------------------------


def _packed(gen, nseq):
    lengths = torch.randint(2, 7, (nseq,), generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    pad = int(torch.randint(0, 3, (1,), generator=gen))
    return cu, int(cu[-1]) + pad


def _block_anchors(gen, b, cu, t):
    """(B,N): first and last token of every sequence, one padding anchor if any, random rest."""
    fixed = torch.stack([cu[:-1], cu[1:] - 1], 1).reshape(-1)
    if t > int(cu[-1]):
        fixed = torch.cat([fixed, torch.tensor([t - 1])])
    rows = [torch.cat([fixed, torch.randint(0, t, (3,), generator=gen)])[torch.randperm(len(fixed) + 3, generator=gen)]
            for _ in range(b)]
    return torch.stack(rows)


SHAPES = [("diagonal", 1, 1), ("diagonal", 3, 3), ("diagonal", 1, 3), ("diagonal", 2, 3),
          ("block", 2, 2), ("block", 4, 4)]  # (local, Gq, Gk)


@pytest.mark.parametrize("local,gq,gk", SHAPES)
@pytest.mark.parametrize("h,hkv", [(4, 2), (2, 2)])
@pytest.mark.parametrize("include_anchor", [True, False])
@pytest.mark.parametrize("nseq", [None, 2, 3])
def test_branch_attention_matches_dense(local, gq, gk, h, hkv, include_anchor, nseq):
    seed = zlib.crc32(repr((local, gq, gk, h, hkv, include_anchor, nseq)).encode())
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    if nseq is None:
        cu, t = None, int(torch.randint(3, 9, (1,), generator=gen))
        cu_for_anchors = torch.tensor([0, t])
    else:
        cu, t = _packed(gen, nseq)
        cu_for_anchors = cu
    if local == "diagonal":
        anchors = None  # one branch per main row (EAGLE-3), covers first/last/padding rows
        n = t
    else:
        anchors = _block_anchors(gen, b, cu_for_anchors, t)
        n = anchors.shape[1]
    q = _rand(b, h, n, gq, d, gen=gen)
    k, v = _rand(b, hkv, n, gk, d, gen=gen), _rand(b, hkv, n, gk, d, gen=gen)
    k_main, v_main = _rand(b, hkv, t, d, gen=gen), _rand(b, hkv, t, d, gen=gen)
    kw = dict(local=local, include_anchor=include_anchor, cu_seqlens=cu)

    def ours(*x):
        return branch_attention_with_lse(*x, anchors, **kw)

    def ref(*x):
        return dense_branch_reference(*x, anchors, **kw)

    inputs = (q, k, v, k_main, v_main)
    o, lse, g = _grads(ours, inputs, torch.Generator().manual_seed(seed + 1))
    ro, rlse, rg = _grads(ref, inputs, torch.Generator().manual_seed(seed + 1))
    assert_close(o, ro)
    assert_close(lse, rlse)
    for name, a, r in zip(("dq", "dk", "dv", "dk_main", "dv_main"), g, rg):
        assert torch.isfinite(a).all(), name
        assert_close(a, r, msg=lambda m, name=name: f"{name}: {m}")


def test_explicit_anchor_subset_and_shared_anchors():
    """Diagonal branches on a subset of rows with (N,) anchors shared across the batch."""
    gen = torch.Generator().manual_seed(7)
    cu, t = torch.tensor([0, 4, 9]), 10
    anchors = torch.tensor([0, 3, 4, 8, 9])
    x = (_rand(2, 4, 5, 2, 8, gen=gen), _rand(2, 2, 5, 3, 8, gen=gen), _rand(2, 2, 5, 3, 8, gen=gen),
         _rand(2, 2, t, 8, gen=gen), _rand(2, 2, t, 8, gen=gen))
    kw = dict(local="diagonal", include_anchor=True, cu_seqlens=cu, scale=0.3)
    o, lse, g = _grads(lambda *a: branch_attention_with_lse(*a, anchors, **kw), x, torch.Generator().manual_seed(8))
    ro, rlse, rg = _grads(lambda *a: dense_branch_reference(*a, anchors, **kw), x, torch.Generator().manual_seed(8))
    assert_close(o, ro)
    assert_close(lse, rlse)
    for a, r in zip(g, rg):
        assert_close(a, r)


def test_eagle3_ttt_step_matches_specforge_formula():
    """Step j of TTT: one softmax over [q·k0ᵀ + causal, (q⊙k1).sum(-1), …, (q⊙kj).sum(-1)]."""
    gen = torch.Generator().manual_seed(9)
    b, h, hkv, t, d, j = 2, 4, 2, 6, 8, 3
    q = torch.randn(b, h, t, d, generator=gen, dtype=F64)
    ks = [torch.randn(b, hkv, t, d, generator=gen, dtype=F64) for _ in range(j + 1)]
    vs = [torch.randn(b, hkv, t, d, generator=gen, dtype=F64) for _ in range(j + 1)]
    rep = h // hkv
    main = q @ ks[0].repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(d)
    main = main.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), NEG_INF)
    diag = [(q * kk.repeat_interleave(rep, 1)).sum(-1, keepdim=True) / math.sqrt(d) for kk in ks[1:]]
    p = torch.softmax(torch.cat([main] + diag, -1), -1)
    ref = p[..., :t] @ vs[0].repeat_interleave(rep, 1)
    for i, vv in enumerate(vs[1:]):
        ref = ref + p[..., t + i : t + i + 1] * vv.repeat_interleave(rep, 1)
    # ours: main = step-0 keys (≤ t), branch = steps 1..j of the same row, query is the last slot
    kb = torch.stack(ks[1:], 3)  # (B,Hkv,T,J,D)
    vb = torch.stack(vs[1:], 3)
    o = branch_attention(q[:, :, :, None], kb, vb, ks[0], vs[0], local="diagonal", include_anchor=True)
    assert_close(o[:, :, :, 0], ref)


def test_low_precision_inputs():
    gen = torch.Generator().manual_seed(10)
    x = [torch.randn(*s, generator=gen) for s in [(1, 4, 3, 4, 16), (1, 2, 3, 4, 16), (1, 2, 3, 4, 16),
                                                   (1, 2, 7, 16), (1, 2, 7, 16)]]
    anchors = torch.tensor([0, 3, 6])
    kw = dict(local="block", include_anchor=False, cu_seqlens=torch.tensor([0, 3, 7]))
    o = branch_attention(*[a.bfloat16() for a in x], anchors, **kw)
    assert o.dtype == torch.bfloat16
    ro, _ = dense_branch_reference(*[a.double() for a in x], anchors, **kw)
    assert_close(o.double(), ro, atol=3e-2, rtol=3e-2)


def test_bad_shapes_raise():
    q = torch.zeros(1, 3, 2, 2, 4)
    k = torch.zeros(1, 2, 2, 2, 4)
    km = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        branch_attention(q, k, k, km, km, torch.tensor([1, 2]), local="block", include_anchor=False)
    q = torch.zeros(1, 2, 2, 3, 4)
    with pytest.raises(ValueError, match="Gq=3"):
        branch_attention(q, k, k, km, km, torch.tensor([1, 2]), local="block", include_anchor=False)
    with pytest.raises(ValueError, match="N=2, T=5"):
        branch_attention(q[:, :, :, :2], k, k, km, km, local="diagonal", include_anchor=True)


@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("include_anchor", [True, False])
def test_per_sequence_main_part_matches_dense(b, include_anchor):
    """DFlash-style blocks with (N,) anchors shared by the batch take the per-sequence path:
    unsorted anchors, two in one sequence, one at a sequence start, two in the padding tail."""
    gen = torch.Generator().manual_seed(11 + b + 2 * include_anchor)
    cu, t = torch.tensor([0, 4, 4, 9, 13]), 16  # an empty sequence, 3 padding rows
    anchors = torch.tensor([10, 2, 14, 4, 0, 6, 15, 12])
    n, g = anchors.numel(), 3
    x = (_rand(b, 4, n, g, 8, gen=gen), _rand(b, 2, n, g, 8, gen=gen), _rand(b, 2, n, g, 8, gen=gen),
         _rand(b, 2, t, 8, gen=gen), _rand(b, 2, t, 8, gen=gen))
    kw = dict(local="block", include_anchor=include_anchor, cu_seqlens=cu)
    o, lse, grads = _grads(lambda *a: branch_attention_with_lse(*a, anchors, **kw), x, torch.Generator().manual_seed(3))
    ro, rlse, rgrads = _grads(lambda *a: dense_branch_reference(*a, anchors, **kw), x, torch.Generator().manual_seed(3))
    assert_close(o, ro)
    assert_close(lse, rlse)
    for a, r in zip(grads, rgrads):
        assert torch.isfinite(a).all()
        assert_close(a, r)
    if b == 2:  # the main part alone against the dense masked form, which (B,N) anchors take
        q, _, _, km, vm = (t.detach() for t in x)
        om, lm = branch_main_part(q, km, vm, anchors, include_anchor=include_anchor, cu_seqlens=cu)
        dm, dl = branch_main_part(q, km, vm, anchors.expand(b, n), include_anchor=include_anchor, cu_seqlens=cu)
        assert_close(om, dm)
        assert_close(lm, dl)
