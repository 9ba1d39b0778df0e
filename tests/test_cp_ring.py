"""Zigzag ring attention (main + branch) on real gloo groups of 2 and 4 ranks, against a
single-process dense masked reference: outputs, LSE, dQ, dK, dV (fp32, ≤ 1e-5 abs)."""
from __future__ import annotations

import pytest
import torch

from codraft.attention import PackedCausal, branch_local_part, dense_branch_reference, merge_lse
from codraft.attention.merge import attention_with_lse
from codraft.parallel.comm import CPGroup
from codraft.parallel.ring import ring_attention, ring_branch_attention
from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard
from dist_harness import run_ranks

TOL = 1e-5
# uneven lengths, some shorter than 2C (for C = 4: 1, 3, 5), GQA 4 query heads over 2 KV heads;
# with shared prefixes (PackedCausal.prefix: two GRPO groups, prompts of 40 and 9 tokens)
PACKINGS = [([1, 3, 17, 40, 5], ()), ([64], ()), ([9, 2, 33], ()),
            ([40, 5, 1, 12, 9, 3, 7], (-1, 0, 0, 0, -1, 4, 4))]


def _inputs(lengths, seed, h=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g)
    v = torch.randn(1, hkv, t, d, generator=g)
    do = torch.randn(1, h, t, d, generator=g)
    dlse = torch.randn(1, h, t, generator=g)
    return cu, t, q, k, v, do, dlse


def _main_case(rank, world, lengths, prefix, seed):
    cu, t, q, k, v, do, dlse = _inputs(lengths, seed)
    # reference: one process, the dense packed causal mask
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    layout = PackedCausal.of(cu, t, prefix)
    o_ref, l_ref = attention_with_lse(qr, kr, vr, layout.dense())
    ((o_ref * do).sum() + (l_ref * dlse).sum()).backward()
    plan = ZigzagPlan.of_layout(layout, world)
    # RoPE positions of the real rows are the layout's
    real = ZigzagShard(plan, rank).index >= 0
    assert torch.equal(ZigzagShard(plan, rank).positions()[real], plan.shard(layout.positions()[None], rank)[0, real])
    shard = ZigzagShard(plan, rank)
    comm = CPGroup.world(timeout=60)
    ql, kl, vl = (plan.shard(x, rank, dim=2).requires_grad_() for x in (q, k, v))
    o, lse = ring_attention(ql, kl, vl, shard, comm)
    ((o * plan.shard(do, rank, dim=2)).sum() + (lse * plan.shard(dlse, rank, dim=2)).sum()).backward()
    real = shard.index >= 0
    errs = {
        "o": (o - plan.shard(o_ref.detach(), rank, dim=2))[:, :, real].abs().max(),
        "lse": (lse - plan.shard(l_ref.detach(), rank, dim=2))[:, :, real].abs().max(),
        "dq": (ql.grad - plan.shard(qr.grad, rank, dim=2))[:, :, real].abs().max(),
        "dk": (kl.grad - plan.shard(kr.grad, rank, dim=2))[:, :, real].abs().max(),
        "dv": (vl.grad - plan.shard(vr.grad, rank, dim=2))[:, :, real].abs().max(),
        # padding rows: no upstream gradient, never seen by a real query -> exactly zero
        "pad_grads": max((x.grad[:, :, ~real].abs().max() if (~real).any() else torch.tensor(0.0))
                         for x in (ql, kl, vl)),
    }
    return {name: float(e) for name, e in errs.items()}, plan.padding_ratio


def _branch_case(rank, world, lengths, seed, gq, local, include_anchor):
    cu, t, _, k_main, v_main, _, _ = _inputs(lengths, seed)
    g = torch.Generator().manual_seed(seed + 1)
    n_anchor = 12
    anchors = torch.randint(0, t, (n_anchor,), generator=g).sort().values
    h, hkv, d = 4, 2, 8
    qb = torch.randn(1, h, n_anchor, gq, d, generator=g)
    kb = torch.randn(1, hkv, n_anchor, gq, d, generator=g)
    vb = torch.randn(1, hkv, n_anchor, gq, d, generator=g)
    do = torch.randn(1, h, n_anchor, gq, d, generator=g)
    ref_in = [x.clone().requires_grad_() for x in (qb, kb, vb, k_main, v_main)]
    o_ref, _ = dense_branch_reference(*ref_in, anchors, local=local, include_anchor=include_anchor, cu_seqlens=cu)
    (o_ref * do).sum().backward()
    # CP: each branch lives on the rank that owns its anchor; main K/V are sharded
    plan = ZigzagPlan.of(cu, world, t)
    shard = ZigzagShard(plan, rank)
    index = shard.index
    local_of = torch.full((t,), -1, dtype=torch.long)
    local_of[index[index >= 0]] = (index >= 0).nonzero()[:, 0]
    mine = (local_of[anchors] >= 0).nonzero()[:, 0]
    q_l, kb_l, vb_l = (x[:, :, mine].clone().requires_grad_() for x in (qb, kb, vb))
    km, vm = (plan.shard(x, rank, dim=2).requires_grad_() for x in (k_main, v_main))
    om, lm = ring_branch_attention(q_l, km, vm, local_of[anchors[mine]], shard, CPGroup.world(timeout=60),
                                   include_anchor=include_anchor)
    ob, lb = branch_local_part(q_l, kb_l, vb_l, local=local)
    o, _ = merge_lse(om, lm, ob, lb)
    (o * do[:, :, mine]).sum().backward()
    real = index >= 0
    errs = {
        "o": (o - o_ref.detach()[:, :, mine]).abs().max() if mine.numel() else torch.tensor(0.0),
        "dq": (q_l.grad - ref_in[0].grad[:, :, mine]).abs().max() if mine.numel() else torch.tensor(0.0),
        "dk_branch": (kb_l.grad - ref_in[1].grad[:, :, mine]).abs().max() if mine.numel() else torch.tensor(0.0),
        "dk_main": (km.grad - plan.shard(ref_in[3].grad, rank, dim=2))[:, :, real].abs().max(),
        "dv_main": (vm.grad - plan.shard(ref_in[4].grad, rank, dim=2))[:, :, real].abs().max(),
    }
    return {name: float(e) for name, e in errs.items()}, int(mine.numel())


def _all_cases(rank, world):
    out = {}
    for i, (lengths, prefix) in enumerate(PACKINGS):
        out[f"main{i}"] = _main_case(rank, world, lengths, prefix, seed=i)
    shapes = {"eagle3_diag": (3, "diagonal", True), "dflash_block": (8, "block", False),
              "dspark_block": (4, "block", False)}
    for name, (gq, local, inc) in shapes.items():
        out[name] = _branch_case(rank, world, PACKINGS[0][0], 7, gq, local, inc)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_dense_reference(world):
    results = run_ranks(_all_cases, world)
    for rank, res in enumerate(results):
        for case, (errs, _) in res.items():
            for name, e in errs.items():
                assert e <= TOL, f"C={world} rank {rank} {case}: max |{name} - ref| = {e:.3g} > {TOL}"
    # every branch was placed somewhere: the ranks' local counts add up to all 12 anchors
    for case in ("eagle3_diag", "dflash_block"):
        assert sum(res[case][1] for res in results) == 12


def test_zigzag_plan_shards_and_gathers():
    plan = ZigzagPlan.of([0, 1, 4, 21, 61], 2)
    assert plan.chunks == [1, 1, 5, 10] and plan.local_len == 34
    assert plan.padding_ratio == pytest.approx(2 * 34 / 61 - 1)
    x = torch.arange(61)[None]
    parts = [plan.shard(x, r) for r in range(2)]
    assert torch.equal(plan.unshard(parts), x)
    # rank r holds chunks r and 2C-1-r of every sequence: for the 40-token sequence (c = 10), rank 0
    # holds positions 0..9 and 30..39, rank 1 positions 10..29
    assert parts[0][0, 14:34].tolist() == list(range(21, 31)) + list(range(51, 61))
    assert parts[1][0, 14:34].tolist() == list(range(31, 51))
    # the 1-token sequence: rank 0 holds it, rank 1 one padding row (-1 in the index, `fill` in the data)
    assert plan.global_index(1)[0] == -1 and parts[1][0, 0] == 0
    with pytest.raises(ValueError, match="padding tail"):
        ZigzagPlan.of([0, 5], 2, total=7)
