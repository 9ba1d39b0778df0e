"""Zigzag ring attention over a ``ZigzagShard``: main-sequence causal attention, and branch
queries (draft TTT steps, DFlash/DSpark blocks) over the main keys, with only main K/V moving.

Forward: the rank's K/V travel the ring in C steps. At step s a rank holds the K/V of rank
src = r − s and, per sequence (local rows [chunk r ; chunk 2C−1−r], see zigzag.py), computes

    s = 0      the diagonal: both local chunks against both, causal;
    src < r    all local queries against src's first chunk (its second chunk lies after both);
    src > r    the second local chunk against both of src's chunks (the first sees neither);

so every step after the first costs the same on every rank. The next shard's send/receive is
posted before the current block is computed. Blocks are merged into a running (O, ℓ) in fp32.

Branch queries stay on the rank that owns their anchor; at each step they attend to the
received keys of their sequence before (or up to) the anchor, masked by padded position. The
drafts merge that result with their local branch part by LSE (``merge_lse``).

Backward: dQ accumulates locally; the dK/dV of each K/V shard ride the ring with it, each rank
adding its share, and arrive back at the owner after C sends. Every block's backward uses the
final merged O and ℓ (and the upstream gradient of ℓ, since branch parts are merged again).

Every rank must make the same sequence of ring calls (they are collective), including ranks
whose query set is empty.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable, NamedTuple

import torch

from codraft.parallel.blocks import block_backward, block_forward
from codraft.parallel.comm import Group
from codraft.parallel.zigzag import ZigzagShard

TAG_KV, TAG_DKV = 11, 12


class Block(NamedTuple):
    q: slice | torch.Tensor  # query rows (slice, or index tensor into the flattened queries)
    k: slice                 # key rows of the shard being visited
    mask: torch.Tensor | None
    causal: bool = False     # the square lower triangle (the diagonal step); mask must be None


Rule = Callable[[int], list[Block]]  # src rank -> the blocks to compute against its K/V


def _take(x: torch.Tensor, sel) -> torch.Tensor:
    return x[:, :, sel] if isinstance(sel, slice) else x.index_select(2, sel)


def _put(x: torch.Tensor, sel, value: torch.Tensor) -> None:
    if isinstance(sel, slice):
        x[:, :, sel] = value
    else:
        x.index_copy_(2, sel, value)


def _add(x: torch.Tensor, sel, value: torch.Tensor) -> None:
    if isinstance(sel, slice):
        x[:, :, sel] += value
    else:
        x.index_add_(2, sel, value)


def _merge_into(o: torch.Tensor, lse: torch.Tensor, sel, ob: torch.Tensor, lb: torch.Tensor) -> None:
    """(o, lse)[sel] ← merge of itself with the block's (ob, lb); empty parts (ℓ = −inf) are NaN-free."""
    oa, la = _take(o, sel), _take(lse, sel)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    tot = wa + wb
    _put(lse, sel, torch.where(tot > 0, m + torch.log(tot), float("-inf")))
    _put(o, sel, (wa[..., None] * oa + wb[..., None] * ob) / tot.clamp_min(1e-38)[..., None])


def attend_blocks(q, kv, blocks: list[Block], o, lse, scale: float) -> None:
    """Merge each block's attention of ``q`` over ``kv`` (2,B,Hkv,T,D) into the running (o, lse)."""
    for blk in blocks:
        ob, lb = block_forward(_take(q, blk.q), kv[0][:, :, blk.k], kv[1][:, :, blk.k], blk.mask, scale, blk.causal)
        _merge_into(o, lse, blk.q, ob, lb)


def block_grads(do, dlse, q, kv, o, lse, delta, blocks: list[Block], scale: float) -> list:
    """[(block, (dQ, dK, dV))] of each block, from the final O, ℓ (see blocks.py)."""
    return [(blk, block_backward(
        _take(do, blk.q), None if dlse is None else _take(dlse, blk.q), _take(q, blk.q),
        kv[0][:, :, blk.k], kv[1][:, :, blk.k], _take(o, blk.q), _take(lse, blk.q), blk.mask, scale,
        delta=_take(delta, blk.q), causal=blk.causal)) for blk in blocks]


def add_block_grads(grads: list, dq, dkv) -> None:
    """Accumulate ``block_grads`` into dq (B,H,T,D) and dkv (2,B,Hkv,T,D)."""
    for blk, (gq, gk, gv) in grads:
        _add(dq, blk.q, gq)
        dkv[0][:, :, blk.k] += gk
        dkv[1][:, :, blk.k] += gv


class _Ring(torch.autograd.Function):
    """Buffers: two K/V buffers and (backward) two fp32 dK/dV buffers, swapped every step: one is
    sent while the other receives, so no step allocates a shard-sized tensor."""

    @staticmethod
    def forward(ctx, q, k, v, rule: Rule, comm: Group, scale: float, what: str):
        ctx.set_materialize_grads(False)  # an unused ℓ (the model's attention) gets no dℓ work
        b, h, tq, d = q.shape
        o = q.new_zeros(b, h, tq, d, dtype=torch.float32)
        lse = q.new_full((b, h, tq), float("-inf"), dtype=torch.float32)
        kv = torch.stack([k, v])  # (2,B,Hkv,T,D): one message per step
        spare = torch.empty_like(kv) if comm.size > 1 else None
        for step in range(comm.size):
            src = (comm.rank - step) % comm.size
            if step < comm.size - 1:
                pending = comm.exchange(kv, spare, what=f"{what} K/V", step=step, tag=TAG_KV)
            attend_blocks(q, kv, rule(src), o, lse, scale)
            if step < comm.size - 1:
                pending.wait()
                kv, spare = spare, kv
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.rule, ctx.comm, ctx.scale, ctx.what = rule, comm, scale, what
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        comm, rule, scale, what = ctx.comm, ctx.rule, ctx.scale, ctx.what
        do = do.float() if do is not None else torch.zeros_like(o)  # (a branch whose O is unused)
        delta = (do * o).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv) if comm.size > 1 else None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # the running dK/dV of src's shard
        dkv_spare = torch.empty_like(dkv) if comm.size > 1 else None
        pending_dkv = None
        for step in range(comm.size):
            src = (comm.rank - step) % comm.size
            if step < comm.size - 1:
                pending_kv = comm.exchange(kv, spare, what=f"{what} K/V (backward)", step=step, tag=TAG_KV)
            grads = block_grads(do, dlse, q, kv, o, lse, delta, rule(src), scale)
            if pending_dkv is not None:  # src's running dK/dV from the ranks before; our last send is done
                pending_dkv.wait()
                dkv, dkv_spare = dkv_spare, dkv
            add_block_grads(grads, dq, dkv)
            del grads
            if comm.size > 1:  # on to the next rank; after C sends every shard's gradient is home
                pending_dkv = comm.exchange(dkv, dkv_spare, what=f"{what} dK/dV", step=step, tag=TAG_DKV)
            if step < comm.size - 1:
                pending_kv.wait()
                kv, spare = spare, kv
        if pending_dkv is not None:
            pending_dkv.wait()
            dkv = dkv_spare
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


# ---- rules ------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def causal_rule(shard: ZigzagShard) -> Rule:
    """The zigzag step rule for main queries over main keys (see the module docstring), plus, for
    a segment with a shared prefix (``plan.prefix``), all of its rows over the prefix segment's
    keys at every step (padding keys masked). Built once per shard and source rank: every layer,
    forward and backward, reuses the blocks."""
    plan, r = shard.plan, shard.rank
    # the rows of every segment that sees prefix p, as one index: one block per prefix and step
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(plan.prefix):
        if p >= 0:
            groups.setdefault(p, []).extend(range(plan.offsets[i], plan.offsets[i] + 2 * plan.chunks[i]))
    rows = {p: torch.tensor(idx, device=shard.device) for p, idx in groups.items()}

    @lru_cache(maxsize=None)
    def rule(src: int) -> list[Block]:
        out = []
        if rows:
            real = plan.padded_positions(src).to(shard.device) < torch.tensor(
                plan.lengths, device=shard.device)[plan.sequence_ids().to(shard.device)]
        for p, q_idx in rows.items():
            keys = slice(plan.offsets[p], plan.offsets[p] + 2 * plan.chunks[p])
            pad = ~real[keys]
            mask = None if not bool(pad.any()) else (~pad)[None].expand(q_idx.numel(), -1)
            out.append(Block(q_idx, keys, mask))
        for off, c in zip(plan.offsets, plan.chunks):
            if src == r:
                out.append(Block(slice(off, off + 2 * c), slice(off, off + 2 * c), None, causal=True))
            elif src < r:
                out.append(Block(slice(off, off + 2 * c), slice(off, off + c), None))
            else:
                out.append(Block(slice(off + c, off + 2 * c), slice(off, off + 2 * c), None))
        return out
    return rule


def branch_rule(shard: ZigzagShard, anchors: torch.Tensor, gq: int, include_anchor: bool) -> Rule:
    """Branch queries (N branches × gq slots, flattened branch-major) over the main keys of
    their anchor's sequence before (``include_anchor``: up to) the anchor."""
    plan = shard.plan
    seq_of = plan.sequence_ids().to(shard.device)
    apos = plan.padded_positions(shard.rank).to(shard.device)[anchors]  # (N,) padded position of each anchor
    aseq = seq_of[anchors]
    per_seq = []
    for i, (off, c, n) in enumerate(zip(plan.offsets, plan.chunks, plan.lengths)):
        mine = (aseq == i).nonzero()[:, 0]
        if mine.numel() == 0:
            continue
        q_idx = (mine[:, None] * gq + torch.arange(gq, device=shard.device)).reshape(-1)
        per_seq.append((off, c, n, q_idx, apos[mine].repeat_interleave(gq)))

    def rule(src: int) -> list[Block]:
        kpos = plan.padded_positions(src).to(shard.device)
        out = []
        for off, c, n, q_idx, qpos in per_seq:
            kp = kpos[off:off + 2 * c]
            before = kp[None] <= qpos[:, None] if include_anchor else kp[None] < qpos[:, None]
            mask = before & (kp < n)[None]
            if bool(mask.any()):
                out.append(Block(q_idx, slice(off, off + 2 * c), mask))
        return out
    return rule


# ---- entry points -----------------------------------------------------------------------------


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: ZigzagShard, comm: Group,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the local rows over the whole sharded row: q (B,H,T_l,D), k/v
    (B,Hkv,T_l,D) -> O (B,H,T_l,D), ℓ (B,H,T_l), fp32."""
    _check(shard, comm, k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _Ring.apply(q, k, v, causal_rule(shard), comm, scale, "main")


def ring_branch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor,
                          shard: ZigzagShard, comm: Group, *, include_anchor: bool,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch main part: q (B,H,N,Gq,D) with anchors (N,) local row indices, over the main k/v
    (B,Hkv,T_l,D) of every rank -> O (B,H,N,Gq,D), ℓ (B,H,N,Gq), fp32."""
    _check(shard, comm, k.shape[2])
    b, h, n, gq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rule = branch_rule(shard, anchors.to(shard.device, torch.long), gq, include_anchor)
    o, lse = _Ring.apply(q.reshape(b, h, n * gq, d), k, v, rule, comm, scale, "branch")
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)


def _check(shard: ZigzagShard, comm: Group, t: int) -> None:
    if shard.plan.world != comm.size or shard.rank != comm.rank:
        raise ValueError(f"shard is rank {shard.rank} of {shard.plan.world}, the CP group is rank {comm.rank} "
                         f"of {comm.size}")
    if t != shard.total:
        raise ValueError(f"k/v have {t} rows, the shard holds {shard.total}")


class RingAttention:
    """The model's attention function under CP: ``Transformer(config, attention=RingAttention(comm))``
    or ``model(ids, layout=shard, attention=...)``; the layout (a ``ZigzagShard``) is the mask."""

    def __init__(self, comm: Group):
        self.comm = comm

    def __call__(self, q, k, v, mask) -> torch.Tensor:
        if not isinstance(mask, ZigzagShard):
            raise TypeError(f"ring attention needs a ZigzagShard layout, got {type(mask).__name__}")
        o, _ = ring_attention(q, k, v, mask, self.comm)
        return o.to(q.dtype)
