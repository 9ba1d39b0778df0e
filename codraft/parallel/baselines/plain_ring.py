"""Plain (contiguous) ring baseline (``plain_ring_attention``, ``ContiguousPlan``): each sequence
is padded to a multiple of C and cut into C contiguous chunks, rank r holds chunk r. K/V travel
the ring in C steps (``ring._Ring`` with another step rule); at step s rank r holds src = r − s
and computes only when src ≤ r: the causal diagonal at s = 0, the full block when src < r,
nothing when src > r, as ring-flash-attention's basic ring does. Rank C−1 does C blocks, rank 0
one: the ring waits for the last rank (imbalanced).

Contract: the package docstring (``codraft.parallel.baselines``)."""
from __future__ import annotations

import torch

from codraft.parallel.baselines.common import _branch_groups, _branch_mask, _causal, _check, _scale
from codraft.parallel.baselines.plans import ContiguousShard
from codraft.parallel.comm import Group
from codraft.parallel.ring import Block, Rule, _Ring


def contiguous_rule(shard: ContiguousShard) -> Rule:
    """The plain ring's step rule: diagonal (causal) for src = r, full for src < r, none for src > r."""
    plan, r = shard.plan, shard.rank
    diag = [_causal(off, off, c) for off, c in zip(plan.offsets, plan.chunks)]
    full = [Block(slice(off, off + c), slice(off, off + c), None) for off, c in zip(plan.offsets, plan.chunks)]
    return lambda src: diag if src == r else (full if src < r else [])


def contiguous_branch_rule(shard: ContiguousShard, anchors: torch.Tensor, gq: int, include_anchor: bool) -> Rule:
    """``ring.branch_rule`` for the contiguous layout (c_i local rows per sequence, not 2c_i)."""
    plan = shard.plan
    groups = _branch_groups(shard, anchors, gq)

    def rule(src: int) -> list[Block]:
        kpos = plan.padded_positions(src).to(shard.device)
        out = []
        for i, q_idx, qpos in groups:
            off, c = plan.offsets[i], plan.chunks[i]
            mask = _branch_mask(kpos[off:off + c], qpos, plan.lengths[i], include_anchor)
            if bool(mask.any()):
                out.append(Block(q_idx, slice(off, off + c), mask))
        return out
    return rule


def plain_ring_attention(q, k, v, shard: ContiguousShard, comm: Group, scale: float | None = None):
    """Causal attention over a contiguous sharding, plain (imbalanced) ring: see the module docstring."""
    _check(shard, comm, k.shape[2], ContiguousShard)
    return _Ring.apply(q, k, v, contiguous_rule(shard), comm, _scale(q, scale), "main")


def plain_ring_branch_attention(q, k, v, anchors, shard: ContiguousShard, comm: Group, *, include_anchor: bool,
                                scale: float | None = None):
    """``ring_branch_attention`` over a contiguous sharding: q (B,H,N,Gq,D), anchors (N,) local rows."""
    _check(shard, comm, k.shape[2], ContiguousShard)
    b, h, n, gq, d = q.shape
    rule = contiguous_branch_rule(shard, anchors.to(shard.device, torch.long), gq, include_anchor)
    o, lse = _Ring.apply(q.reshape(b, h, n * gq, d), k, v, rule, comm, _scale(q, scale), "branch")
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)
