"""All-gather K/V baseline (``allgather_attention``, zigzag-sharded: ``ZigzagShard``): every rank
gathers all K/V (``dist.all_gather``), reorders them into sequence order and runs its local
queries against its sequences' keys with the causal mask by padded position (per local chunk:
the full prefix before the chunk plus the causal diagonal). Backward gathers K/V again (they
are not kept: memory like the ring's) and sums every rank's dK/dV back to the owner with
``dist.reduce_scatter`` (gloo has it: checked on torch 2.13; an all-reduce + slice is the
fallback). Not overlapped: the whole gather is exposed. Like the Llama-3 CP and TE's
``all_gather`` mode.

Contract: the package docstring (``codraft.parallel.baselines``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from codraft.parallel.baselines.common import _branch_groups, _branch_mask, _causal, _check, _count, _scale
from codraft.parallel.comm import Group
from codraft.parallel.ring import Block, add_block_grads, attend_blocks, block_grads
from codraft.parallel.zigzag import ZigzagShard


def _no_prefix(shard) -> None:
    if any(p >= 0 for p in getattr(shard.plan, "prefix", ())):
        raise NotImplementedError("the all-gather baseline has no shared prompt prefixes (ZigzagPlan.prefix)")


def _gather_order(shard: ZigzagShard) -> tuple[torch.Tensor, list[int]]:
    """Rows of the rank-major gathered K/V in sequence order (each sequence's padded positions
    0..2C·c_i − 1), and where each sequence starts in that order."""
    plan = shard.plan
    starts = [plan.world * o for o in plan.offsets]
    st = torch.tensor(starts, dtype=torch.long)
    seq = plan.sequence_ids()
    keys = torch.cat([st[seq] + plan.padded_positions(r) for r in range(plan.world)])
    order = torch.empty_like(keys)
    order[keys] = torch.arange(keys.numel())
    return order.to(shard.device), starts


def _all_gather_kv(k: torch.Tensor, v: torch.Tensor, comm: Group, order: torch.Tensor) -> torch.Tensor:
    """(2,B,Hkv,T_l,D) local -> (2,B,Hkv,C·T_l,D) every rank's K/V, in sequence order."""
    kv = torch.stack([k, v]).contiguous()
    if comm.size == 1:
        return kv
    buf = kv.new_empty(comm.size, *kv.shape)
    dist.all_gather(list(buf.unbind(0)), kv, group=comm.group)
    _count(comm, (comm.size - 1) * kv.numel() * kv.element_size())
    full = buf.permute(1, 2, 3, 0, 4, 5).reshape(*kv.shape[:3], comm.size * kv.shape[3], kv.shape[4])
    return full.index_select(3, order)


def _reduce_scatter_kv(dkv: torch.Tensor, comm: Group, order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_all_gather_kv`` for gradients: (2,B,Hkv,C·T_l,D) in sequence order -> the sum
    over ranks of this rank's (2,B,Hkv,T_l,D)."""
    if comm.size == 1:
        return dkv
    ranked = torch.empty_like(dkv)
    ranked.index_copy_(3, order, dkv)
    c, t = comm.size, dkv.shape[3] // comm.size
    parts = ranked.reshape(*dkv.shape[:3], c, t, dkv.shape[4]).permute(3, 0, 1, 2, 4, 5).contiguous()
    out = parts.new_empty(parts.shape[1:])
    try:
        dist.reduce_scatter(out, list(parts.unbind(0)), group=comm.group)
    except RuntimeError as e:  # a gloo without reduce_scatter
        if "reduce_scatter" not in str(e) and "not support" not in str(e):
            raise
        dist.all_reduce(parts, group=comm.group)
        out = parts[comm.rank]
    _count(comm, (c - 1) * out.numel() * out.element_size())
    return out


class _AllGatherAttention(torch.autograd.Function):
    """Local queries against all-gathered K/V, by ``blocks`` (query rows, key rows in the gathered
    sequence order, mask); K/V gathered again in backward, dK/dV reduce-scattered to the owner."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, order, comm, scale):
        ctx.set_materialize_grads(False)  # an unused ℓ gets no dℓ work
        b, h, tq, d = q.shape
        o = q.new_zeros(b, h, tq, d, dtype=torch.float32)
        lse = q.new_full((b, h, tq), float("-inf"), dtype=torch.float32)
        kv = _all_gather_kv(k, v, comm, order)
        attend_blocks(q, kv, blocks, o, lse, scale)
        del kv
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks, ctx.order, ctx.comm, ctx.scale = blocks, order, comm, scale
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.float() if do is not None else torch.zeros_like(o)
        delta = (do * o).sum(-1)
        kv = _all_gather_kv(k, v, ctx.comm, ctx.order)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        add_block_grads(block_grads(do, dlse, q, kv, o, lse, delta, ctx.blocks, ctx.scale), dq, dkv)
        del kv
        dkv = _reduce_scatter_kv(dkv, ctx.comm, ctx.order)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def allgather_causal_blocks(shard: ZigzagShard, starts: list[int]) -> list[Block]:
    """Per sequence and local chunk k (padded positions k·c..): all earlier keys in full, and the
    causal diagonal against its own positions."""
    plan, r = shard.plan, shard.rank
    out = []
    for off, c, s0 in zip(plan.offsets, plan.chunks, starts):
        for row, k in ((off, r), (off + c, 2 * plan.world - 1 - r)):
            if k:
                out.append(Block(slice(row, row + c), slice(s0, s0 + k * c), None))
            out.append(_causal(row, s0 + k * c, c))
    return out


def allgather_attention(q, k, v, shard: ZigzagShard, comm: Group, scale: float | None = None):
    """Causal attention of zigzag-sharded rows against all-gathered K/V: see the module docstring."""
    _check(shard, comm, k.shape[2], ZigzagShard)
    _no_prefix(shard)
    order, starts = _gather_order(shard)
    blocks = allgather_causal_blocks(shard, starts)
    return _AllGatherAttention.apply(q, k, v, blocks, order, comm, _scale(q, scale))


def allgather_branch_attention(q, k, v, anchors, shard: ZigzagShard, comm: Group, *, include_anchor: bool,
                               scale: float | None = None):
    """``ring_branch_attention``'s contract with all-gathered K/V: each sequence's branches against
    its whole gathered sequence, masked by anchor position."""
    _check(shard, comm, k.shape[2], ZigzagShard)
    _no_prefix(shard)
    b, h, n, gq, d = q.shape
    plan = shard.plan
    order, starts = _gather_order(shard)
    blocks = []
    for i, q_idx, qpos in _branch_groups(shard, anchors.to(shard.device, torch.long), gq):
        span = 2 * plan.world * plan.chunks[i]
        kpos = torch.arange(span, device=shard.device)
        mask = _branch_mask(kpos, qpos, plan.lengths[i], include_anchor)
        if bool(mask.any()):
            blocks.append(Block(q_idx, slice(starts[i], starts[i] + span), mask))
    o, lse = _AllGatherAttention.apply(q.reshape(b, h, n * gq, d), k, v, blocks, order, comm, _scale(q, scale))
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)
