"""The cases tests/distributed/test_cp_ring.py and tests/distributed/test_cp_baselines.py run in every rank: one CP
attention method (``codraft.parallel.baselines.METHODS``) against the single-process dense
masked reference, returning the max |error| of each output and gradient on this rank's rows."""
from __future__ import annotations

import torch

from codraft.attention import PackedCausal, branch_local_part, dense_branch_reference, merge_lse
from codraft.attention.merge import attention_with_lse
from codraft.parallel.baselines import METHODS
from codraft.parallel.comm import Group


def inputs(lengths, seed, h=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(1, h, t, d, generator=g)
    k = torch.randn(1, hkv, t, d, generator=g)
    v = torch.randn(1, hkv, t, d, generator=g)
    do = torch.randn(1, h, t, d, generator=g)
    dlse = torch.randn(1, h, t, generator=g)
    return cu, t, q, k, v, do, dlse


def main_case(rank, world, lengths, seed, method="zigzag", plan_opts=None, prefix=()) -> dict:
    """Causal attention of the packed sequences (``prefix``: shared prefixes, zigzag only): O, ℓ,
    dQ, dK, dV on the real rows, and the padding rows' gradients (exactly zero expected)."""
    cu, t, q, k, v, do, dlse = inputs(lengths, seed)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    layout = PackedCausal.of(cu, t, prefix)
    o_ref, l_ref = attention_with_lse(qr, kr, vr, layout.dense())
    ((o_ref * do).sum() + (l_ref * dlse).sum()).backward()
    m = METHODS[method]
    plan = m.plan(cu, world, t, **({"prefix": prefix} if prefix else {}), **(plan_opts or {}))
    shard = m.shard(plan, rank)
    real = shard.index >= 0
    if method == "zigzag":  # RoPE positions of the real rows are the layout's
        assert torch.equal(shard.positions()[real], plan.shard(layout.positions()[None], rank)[0, real])
    ql, kl, vl = (plan.shard(x, rank, dim=2).requires_grad_() for x in (q, k, v))
    o, lse = m.attention(ql, kl, vl, shard, Group.world(timeout=60))
    ((o * plan.shard(do, rank, dim=2)).sum() + (lse * plan.shard(dlse, rank, dim=2)).sum()).backward()
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
    return {name: float(e.detach()) for name, e in errs.items()}


def branch_case(rank, world, method, lengths, seed, gq, local, include_anchor) -> tuple[dict, int]:
    """12 branches of ``gq`` slots (each on the rank that owns its anchor) over the sharded main
    K/V, merged with their local part: O and the gradients; and how many branches this rank held."""
    cu, t, _, k_main, v_main, _, _ = inputs(lengths, seed)
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
    m = METHODS[method]
    plan = m.plan(cu, world, t)
    shard = m.shard(plan, rank)
    index = shard.index
    local_of = torch.full((t,), -1, dtype=torch.long)
    local_of[index[index >= 0]] = (index >= 0).nonzero()[:, 0]
    mine = (local_of[anchors] >= 0).nonzero()[:, 0]
    q_l, kb_l, vb_l = (x[:, :, mine].clone().requires_grad_() for x in (qb, kb, vb))
    km, vm = (plan.shard(x, rank, dim=2).requires_grad_() for x in (k_main, v_main))
    om, lm = m.branch(q_l, km, vm, local_of[anchors[mine]], shard, Group.world(timeout=60),
                      include_anchor=include_anchor)
    ob, lb = branch_local_part(q_l, kb_l, vb_l, local=local)
    o, _ = merge_lse(om, lm, ob, lb)
    (o * do[:, :, mine]).sum().backward()
    real = index >= 0
    zero = torch.tensor(0.0)
    errs = {
        "o": (o - o_ref.detach()[:, :, mine]).abs().max() if mine.numel() else zero,
        "dq": (q_l.grad - ref_in[0].grad[:, :, mine]).abs().max() if mine.numel() else zero,
        "dk_branch": (kb_l.grad - ref_in[1].grad[:, :, mine]).abs().max() if mine.numel() else zero,
        "dk_main": (km.grad - plan.shard(ref_in[3].grad, rank, dim=2))[:, :, real].abs().max(),
        "dv_main": (vm.grad - plan.shard(ref_in[4].grad, rank, dim=2))[:, :, real].abs().max(),
    }
    return {name: float(e.detach()) for name, e in errs.items()}, int(mine.numel())
