"""Context-parallel attention baselines for the zigzag ring: plain (contiguous) ring, all-gather
K/V, and USP (Ulysses all-to-all + ring). Same contract as ``ring.ring_attention``:

    fn(q (B,H,T_l,D), k/v (B,Hkv,T_l,D), shard, comm) -> O (B,H,T_l,D) fp32, ℓ (B,H,T_l) fp32

causal attention of the packed sequences of one row, sharded over the C ranks of ``comm`` as
``shard`` describes; differentiable (dQ, dK, dV, including the upstream gradient of ℓ); every
rank must make the same calls (they are collective). Each method has its own sharding plan
(``shard``/``unshard``/``global_index``/``padded_positions`` as ``ZigzagPlan``) and per-rank view
(``total``/``index``/``positions()`` as ``ZigzagShard``); the generic parts are ZigzagPlan's own
functions, shared, not copied (``_RowPlan``). ``METHODS`` names them all for tests and benchmarks.

* **plain ring** (``plain_ring_attention``, ``ContiguousPlan``): each sequence is padded to a
  multiple of C and cut into C contiguous chunks, rank r holds chunk r. K/V travel the ring in C
  steps (``ring._Ring`` with another step rule); at step s rank r holds src = r − s and computes
  only when src ≤ r: the causal diagonal at s = 0, the full block when src < r, nothing when
  src > r, as ring-flash-attention's basic ring does. Rank C−1 does C blocks, rank 0 one: the
  ring waits for the last rank (imbalanced).
* **all-gather K/V** (``allgather_attention``, zigzag-sharded: ``ZigzagShard``): every rank
  gathers all K/V (``dist.all_gather``), reorders them into sequence order and runs its local
  queries against its sequences' keys with the causal mask by padded position (per local chunk:
  the full prefix before the chunk plus the causal diagonal). Backward gathers K/V again (they
  are not kept: memory like the ring's) and sums every rank's dK/dV back to the owner with
  ``dist.reduce_scatter`` (gloo has it: checked on torch 2.13; an all-reduce + slice is the
  fallback). Not overlapped: the whole gather is exposed. Like the Llama-3 CP and TE's
  ``all_gather`` mode.
* **USP** (``usp_attention``, ``UspPlan``): Ulysses degree U, ring degree R = C/U, ranks
  ρ·U + υ (Ulysses groups are contiguous ranks, ring groups strided, as yunchang's
  ``use_ulysses_low``). Each sequence is padded to a multiple of 2C and cut into 2R zigzag chunks,
  each split into U contiguous pieces; rank (ρ, υ) holds piece υ of chunks ρ and 2R−1−ρ. An
  all-to-all over the Ulysses group turns (local rows, all heads) into (the ring rank's rows, H/U
  heads), the rows are reordered into the zigzag layout of the ring group, the zigzag ring runs
  there (``ring_attention`` on a ring subgroup; a ring of one rank when R = 1 is plain local causal
  attention), and the inverse all-to-all brings O and ℓ back. Heads must split over U: the KV
  heads are padded with zeros to a multiple of U and the query heads with them, keeping the
  query/KV ratio (padded query head h reads padded KV head h // ratio), as yunchang's callers do
  (yunchang itself only asserts the divisibility); padded heads cost compute and are cut off at
  the end. Default **U = C** (pure Ulysses, R = 1: no ring at all, the configuration USP users
  pick when the heads allow); at C = 4 with the tiny policy's 2 KV heads that means padding KV
  heads to 4 and query heads to 8, i.e. twice the attention work per rank. ``UspPlan.of(...,
  ulysses=u)`` picks another split (u = 2 at C = 4: two KV heads split exactly, a zigzag ring of 2).
  gloo has ``all_to_all_single`` (checked on torch 2.13); if a build lacks it, an all-gather of
  the input and a slice replaces it (U× the bytes; said once on stderr).

Branches (draft queries over the main keys, see ``ring.ring_branch_attention``): the plain ring
and all-gather have ``*_branch_attention`` with ring_branch_attention's contract; USP does not
(branch queries live on their anchor's rank and would need an uneven all-to-all of their own:
SpecForge's USP has EAGLE-3 TTT only, whose steps are ordinary causal calls, and no block drafts).

Kernels: every method computes its blocks with ``blocks.block_forward``/``block_backward``, as
the zigzag ring does: square causal diagonals and unmasked blocks as ``Block(..., causal=...)``
(PyTorch's CPU flash kernel), masked branch blocks by the explicit form. So the methods differ in
layout, schedule and communication only.

Communicated bytes: the ring's point-to-point bytes are counted by ``CPGroup.sent_bytes``; the
collectives here add what a bandwidth-optimal algorithm sends per rank (all-gather and
reduce-scatter: (C−1)·local bytes; all-to-all: (U−1)/U of the input) to the same counter.
``comm_bytes(comm)`` also adds the ring subgroups USP creates.
"""
from __future__ import annotations

import datetime
import math
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from codraft.parallel.comm import CPGroup
from codraft.parallel.ring import (Block, Rule, _Ring, add_block_grads, attend_blocks, block_grads, ring_attention,
                                   ring_branch_attention)
from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard

_Z, _ZS = ZigzagPlan.__dict__, ZigzagShard.__dict__


# ---- plans ------------------------------------------------------------------------------------


class _RowPlan:
    """The parts of ``ZigzagPlan`` that only need ``chunks``/``sequence_ids``/``padded_positions``
    (global index, shard, unshard, padding ratio), shared with the plans below. A subclass defines
    which padded positions each rank holds; it is not a ZigzagPlan (the zigzag ring refuses it).
    No shared prompt prefixes (``ZigzagPlan.prefix``): every sequence is self-contained."""
    prefix = ()  # (ZigzagPlan.prefix: none here)
    lengths = _Z["lengths"]
    total = _Z["total"]
    padding_ratio = _Z["padding_ratio"]
    global_index = _Z["global_index"]
    shard = _Z["shard"]
    unshard = _Z["unshard"]
    _check_rank = _Z["_check_rank"]

    def rope_positions(self, rank: int) -> torch.Tensor:
        return self.padded_positions(rank)


def _validated(cu_seqlens, world: int, total: int | None) -> tuple[int, ...]:
    return ZigzagPlan.of(cu_seqlens, world, total).bounds


class _RowShard:
    """``ZigzagShard``'s ``total``/``index``/``positions()`` over any plan here."""
    total = _ZS["total"]
    index = _ZS["index"]

    def positions(self) -> torch.Tensor:
        """RoPE positions: the padded position inside the sequence (padding rows continue counting)."""
        return self.plan.padded_positions(self.rank).to(self.device)


@dataclass(frozen=True)
class ContiguousPlan(_RowPlan):
    """Plain ring sharding: sequence i padded to C·c_i (c_i = ceil(L_i / C)), rank r holds its
    chunk r, positions [r·c_i, (r+1)·c_i). Local row = its sequences' chunks, in sequence order."""
    bounds: tuple[int, ...]
    world: int

    @classmethod
    def of(cls, cu_seqlens, world: int, total: int | None = None) -> "ContiguousPlan":
        return cls(_validated(cu_seqlens, world, total), world)

    @cached_property
    def chunks(self) -> list[int]:
        return [-(-n // self.world) for n in self.lengths]

    @property
    def local_len(self) -> int:
        return sum(self.chunks)

    @cached_property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for c in self.chunks:
            out.append(o)
            o += c
        return out

    def padded_positions(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        parts = [torch.arange(rank * c, (rank + 1) * c) for c in self.chunks]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def sequence_ids(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.chunks)), torch.tensor(self.chunks))


@dataclass(frozen=True)
class ContiguousShard(_RowShard):
    plan: ContiguousPlan
    rank: int
    device: torch.device | str = "cpu"


@dataclass(frozen=True)
class UspPlan(_RowPlan):
    """USP sharding (module docstring): Ulysses degree ``ulysses`` = U, ring degree R = C/U.
    Sequence i is padded to 2C·c_i (c_i = ceil(L_i / 2C), as zigzag); rank ρ·U + υ holds
    positions [(k·U + υ)·c_i, +c_i) for the zigzag chunks k = ρ and 2R−1−ρ of the ring."""
    bounds: tuple[int, ...]
    world: int
    ulysses: int

    chunks = _Z["chunks"]
    local_len = _Z["local_len"]
    offsets = _Z["offsets"]
    sequence_ids = _Z["sequence_ids"]

    @classmethod
    def of(cls, cu_seqlens, world: int, total: int | None = None, ulysses: int | None = None) -> "UspPlan":
        bounds = _validated(cu_seqlens, world, total)
        u = world if ulysses is None else int(ulysses)
        if u < 1 or world % u:
            raise ValueError(f"the Ulysses degree must divide the CP size {world}, got {u}")
        return cls(bounds, world, u)

    @property
    def ring(self) -> int:
        return self.world // self.ulysses

    def padded_positions(self, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        rho, ups = divmod(rank, self.ulysses)
        parts = []
        for c in self.chunks:
            for k in (rho, 2 * self.ring - 1 - rho):
                start = (k * self.ulysses + ups) * c
                parts.append(torch.arange(start, start + c))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    @cached_property
    def ring_plan(self) -> ZigzagPlan:
        """The zigzag plan of the ring group: the sequences at their padded lengths 2C·c_i, so
        that its chunks are the unions U·c_i of the Ulysses pieces (padding rows are real rows
        to the ring: they lie after every real token of their sequence, nothing real sees them)."""
        cu = [0]
        for c in self.chunks:
            cu.append(cu[-1] + 2 * self.world * c)
        return ZigzagPlan.of(cu, self.ring)


@dataclass(frozen=True)
class UspShard(_RowShard):
    plan: UspPlan
    rank: int
    device: torch.device | str = "cpu"

    @cached_property
    def ring_shard(self) -> ZigzagShard:
        return ZigzagShard(self.plan.ring_plan, self.rank // self.plan.ulysses, self.device)

    @cached_property
    def ring_order(self) -> torch.Tensor:
        """(U·T_l,) for each row of the ring layout, its row in the all-to-all output (the Ulysses
        group's local rows concatenated in rank order)."""
        p, u = self.plan, self.plan.ulysses
        rho = self.rank // u
        seq = p.sequence_ids()
        span = 2 * p.world * max(p.chunks, default=1)
        got = torch.cat([seq * span + p.padded_positions(rho * u + j) for j in range(u)])
        want = p.ring_plan.sequence_ids() * span + p.ring_plan.padded_positions(rho)
        order = torch.empty_like(want)
        order[torch.argsort(want)] = torch.argsort(got)
        return order.to(self.device)


# ---- step rules (ring._Ring takes src rank -> blocks) ------------------------------------------


def _causal(q0: int, k0: int, n: int) -> Block:
    """Rows q0..q0+n against keys k0..k0+n, causal (row i sees keys <= i)."""
    return Block(slice(q0, q0 + n), slice(k0, k0 + n), None, causal=True)


def contiguous_rule(shard: ContiguousShard) -> Rule:
    """The plain ring's step rule: diagonal (causal) for src = r, full for src < r, none for src > r."""
    plan, r = shard.plan, shard.rank
    diag = [_causal(off, off, c) for off, c in zip(plan.offsets, plan.chunks)]
    full = [Block(slice(off, off + c), slice(off, off + c), None) for off, c in zip(plan.offsets, plan.chunks)]
    return lambda src: diag if src == r else (full if src < r else [])


def _branch_groups(shard, anchors: torch.Tensor, gq: int):
    """Per sequence with branches: (sequence, query rows (flattened branch-major), anchor padded positions)."""
    plan = shard.plan
    seq_of = plan.sequence_ids().to(shard.device)
    apos, aseq = shard.positions()[anchors], seq_of[anchors]
    out = []
    for i in range(len(plan.lengths)):
        mine = (aseq == i).nonzero()[:, 0]
        if mine.numel():
            q_idx = (mine[:, None] * gq + torch.arange(gq, device=shard.device)).reshape(-1)
            out.append((i, q_idx, apos[mine].repeat_interleave(gq)))
    return out


def _branch_mask(kpos: torch.Tensor, qpos: torch.Tensor, n: int, include_anchor: bool) -> torch.Tensor:
    before = kpos[None] <= qpos[:, None] if include_anchor else kpos[None] < qpos[:, None]
    return before & (kpos < n)[None]


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


# ---- plain ring -------------------------------------------------------------------------------


def _check(shard, comm: CPGroup, t: int, kind) -> None:
    if not isinstance(shard, kind):
        raise TypeError(f"this attention needs a {kind.__name__}, got {type(shard).__name__}")
    if shard.plan.world != comm.size or shard.rank != comm.rank:
        raise ValueError(f"shard is rank {shard.rank} of {shard.plan.world}, the CP group is rank {comm.rank} "
                         f"of {comm.size}")
    if t != shard.total:
        raise ValueError(f"k/v have {t} rows, the shard holds {shard.total}")


def _no_prefix(shard) -> None:
    if any(p >= 0 for p in getattr(shard.plan, "prefix", ())):
        raise NotImplementedError("the all-gather baseline has no shared prompt prefixes (ZigzagPlan.prefix)")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def plain_ring_attention(q, k, v, shard: ContiguousShard, comm: CPGroup, scale: float | None = None):
    """Causal attention over a contiguous sharding, plain (imbalanced) ring: see the module docstring."""
    _check(shard, comm, k.shape[2], ContiguousShard)
    return _Ring.apply(q, k, v, contiguous_rule(shard), comm, _scale(q, scale), "main")


def plain_ring_branch_attention(q, k, v, anchors, shard: ContiguousShard, comm: CPGroup, *, include_anchor: bool,
                                scale: float | None = None):
    """``ring_branch_attention`` over a contiguous sharding: q (B,H,N,Gq,D), anchors (N,) local rows."""
    _check(shard, comm, k.shape[2], ContiguousShard)
    b, h, n, gq, d = q.shape
    rule = contiguous_branch_rule(shard, anchors.to(shard.device, torch.long), gq, include_anchor)
    o, lse = _Ring.apply(q.reshape(b, h, n * gq, d), k, v, rule, comm, _scale(q, scale), "branch")
    return o.reshape(b, h, n, gq, d), lse.reshape(b, h, n, gq)


# ---- all-gather K/V ---------------------------------------------------------------------------


def _count(comm: CPGroup, nbytes: float) -> None:
    comm.sent_bytes += int(nbytes)


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


def _all_gather_kv(k: torch.Tensor, v: torch.Tensor, comm: CPGroup, order: torch.Tensor) -> torch.Tensor:
    """(2,B,Hkv,T_l,D) local -> (2,B,Hkv,C·T_l,D) every rank's K/V, in sequence order."""
    kv = torch.stack([k, v]).contiguous()
    if comm.size == 1:
        return kv
    buf = kv.new_empty(comm.size, *kv.shape)
    dist.all_gather(list(buf.unbind(0)), kv, group=comm.group)
    _count(comm, (comm.size - 1) * kv.numel() * kv.element_size())
    full = buf.permute(1, 2, 3, 0, 4, 5).reshape(*kv.shape[:3], comm.size * kv.shape[3], kv.shape[4])
    return full.index_select(3, order)


def _reduce_scatter_kv(dkv: torch.Tensor, comm: CPGroup, order: torch.Tensor) -> torch.Tensor:
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


def allgather_attention(q, k, v, shard: ZigzagShard, comm: CPGroup, scale: float | None = None):
    """Causal attention of zigzag-sharded rows against all-gathered K/V: see the module docstring."""
    _check(shard, comm, k.shape[2], ZigzagShard)
    _no_prefix(shard)
    order, starts = _gather_order(shard)
    blocks = allgather_causal_blocks(shard, starts)
    return _AllGatherAttention.apply(q, k, v, blocks, order, comm, _scale(q, scale))


def allgather_branch_attention(q, k, v, anchors, shard: ZigzagShard, comm: CPGroup, *, include_anchor: bool,
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


# ---- USP --------------------------------------------------------------------------------------

_A2A_FALLBACK: list[bool] = []  # [True] once all_to_all_single was found missing


def _all_to_all(x: torch.Tensor, comm: CPGroup) -> torch.Tensor:
    """x (U, ...) contiguous: piece j goes to rank j; returns (U, ...) with piece j from rank j."""
    out = torch.empty_like(x)
    if not _A2A_FALLBACK:
        try:
            dist.all_to_all_single(out, x, group=comm.group)
            _count(comm, (comm.size - 1) * x.numel() * x.element_size() // comm.size)
            return out
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            _A2A_FALLBACK.append(True)
            print(f"codraft: all_to_all_single unavailable on this backend ({e}); USP uses all_gather + slice",
                  file=sys.stderr)
    buf = x.new_empty(comm.size, *x.shape)
    dist.all_gather(list(buf.unbind(0)), x, group=comm.group)
    _count(comm, (comm.size - 1) * x.numel() * x.element_size())
    return buf[:, comm.rank].contiguous()


def _seq_to_heads(x: torch.Tensor, comm: CPGroup) -> torch.Tensor:
    """(B,H,T,*) with all heads of T local rows -> (B,H/U,U·T,*): H/U heads of the group's rows."""
    u = comm.size
    if u == 1:
        return x
    b, h, t = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, u, h // u, t, *rest).transpose(0, 1).contiguous()  # (U,B,H/U,T,*)
    got = _all_to_all(send, comm)  # (U: source rank, B, H/U, T, *)
    return got.permute(1, 2, 0, *range(3, got.dim())).reshape(b, h // u, u * t, *rest)


def _heads_to_seq(x: torch.Tensor, comm: CPGroup) -> torch.Tensor:
    """Inverse of ``_seq_to_heads``: (B,H/U,U·T,*) -> (B,H,T,*)."""
    u = comm.size
    if u == 1:
        return x
    b, hu, ut = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, hu, u, ut // u, *rest).permute(2, 0, 1, *range(3, x.dim() + 1)).contiguous()  # (U,B,H/U,T,*)
    got = _all_to_all(send, comm)  # (U: source rank = head group, B, H/U, T, *)
    return got.transpose(0, 1).reshape(b, hu * u, ut // u, *rest)


class _Relayout(torch.autograd.Function):
    """An all-to-all layout change (``there``) whose gradient is the inverse change (``back``)."""

    @staticmethod
    def forward(ctx, x, comm, there, back):
        ctx.comm, ctx.back = comm, back
        return there(x, comm)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g.contiguous(), ctx.comm), None, None, None


_USP_GROUPS: dict = {}  # (id(group), size, U) -> (Ulysses CPGroup, ring CPGroup) made by dist.new_group


def _usp_groups(comm: CPGroup, u: int) -> tuple[CPGroup, CPGroup]:
    """(Ulysses group, ring group) of this rank. U = C or U = 1 reuse ``comm`` (the other one is a
    group of one, which never communicates); otherwise the subgroups are created once per
    (group, U), by all ranks together (every rank creates every group, in the same order)."""
    c = comm.size
    if u == c:
        return comm, CPGroup(None, 0, 1, comm.timeout)
    if u == 1:
        return CPGroup(None, 0, 1, comm.timeout), comm
    key = (id(comm.group), c, u)
    if key not in _USP_GROUPS:
        r, td = c // u, datetime.timedelta(seconds=comm.timeout)  # (gloo's default would be 30 min)
        ug = rg = None
        for rho in range(r):
            g = dist.new_group([comm.global_rank(rho * u + j) for j in range(u)], timeout=td)
            if comm.rank // u == rho:
                ug = CPGroup(g, comm.rank % u, u, comm.timeout)
        for j in range(u):
            g = dist.new_group([comm.global_rank(rho * u + j) for rho in range(r)], timeout=td)
            if comm.rank % u == j:
                rg = CPGroup(g, comm.rank // u, r, comm.timeout)
        _USP_GROUPS[key] = (ug, rg)
    return _USP_GROUPS[key]


def _subgroups(comm: CPGroup) -> list[CPGroup]:
    return [g for key, groups in _USP_GROUPS.items() if key[:2] == (id(comm.group), comm.size) for g in groups]


def comm_bytes(comm: CPGroup) -> int:
    """Bytes this rank sent through ``comm`` and the USP subgroups made from its group."""
    return comm.sent_bytes + sum(g.sent_bytes for g in _subgroups(comm))


def reset_comm_bytes(comm: CPGroup) -> None:
    for g in [comm, *_subgroups(comm)]:
        g.sent_bytes = 0


def _pad_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    if x.shape[1] == n:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], *x.shape[2:])], dim=1)


def usp_heads(h: int, hkv: int, u: int) -> tuple[int, int]:
    """(query heads, KV heads) after padding for Ulysses degree u: KV heads up to a multiple of u,
    query heads with them at the same ratio."""
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    hkv_p = -(-hkv // u) * u
    return hkv_p * (h // hkv), hkv_p


def usp_attention(q, k, v, shard: UspShard, comm: CPGroup, scale: float | None = None):
    """Causal attention by USP (Ulysses all-to-all over heads + zigzag ring): module docstring."""
    _check(shard, comm, k.shape[2], UspShard)
    plan = shard.plan
    ucomm, rcomm = _usp_groups(comm, plan.ulysses)
    h, hkv = q.shape[1], k.shape[1]
    hp, hkvp = usp_heads(h, hkv, plan.ulysses)
    scale = _scale(q, scale)
    order = shard.ring_order
    back = torch.argsort(order)
    qa, ka, va = (_Relayout.apply(_pad_heads(x, n), ucomm, _seq_to_heads, _heads_to_seq).index_select(2, order)
                  for x, n in ((q, hp), (k, hkvp), (v, hkvp)))
    o, lse = ring_attention(qa, ka, va, shard.ring_shard, rcomm, scale)
    o = _Relayout.apply(o.index_select(2, back), ucomm, _heads_to_seq, _seq_to_heads)
    lse = _Relayout.apply(lse.index_select(2, back), ucomm, _heads_to_seq, _seq_to_heads)
    return o[:, :h], lse[:, :h]


# ---- the registry -------------------------------------------------------------------------


class Method(NamedTuple):
    """A CP attention method: how to shard a row, and its attention functions."""
    plan: Callable   # (cu_seqlens, world, total) -> plan
    shard: Callable  # (plan, rank, device) -> per-rank view
    attention: Callable  # (q, k, v, shard, comm, scale=None) -> (O, ℓ)
    branch: Callable | None  # ring_branch_attention's contract, or None: the method cannot place branches


METHODS: dict[str, Method] = {
    "zigzag": Method(ZigzagPlan.of, ZigzagShard, ring_attention, ring_branch_attention),
    "ring": Method(ContiguousPlan.of, ContiguousShard, plain_ring_attention, plain_ring_branch_attention),
    "allgather": Method(ZigzagPlan.of, ZigzagShard, allgather_attention, allgather_branch_attention),
    "usp": Method(UspPlan.of, UspShard, usp_attention, None),
}

__all__ = ["ContiguousPlan", "ContiguousShard", "UspPlan", "UspShard", "plain_ring_attention",
           "plain_ring_branch_attention", "allgather_attention", "allgather_branch_attention", "usp_attention",
           "contiguous_rule", "usp_heads", "comm_bytes", "reset_comm_bytes",
           "METHODS", "Method"]
