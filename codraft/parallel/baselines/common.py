"""Helpers every baseline shares: argument checks, the default scale, the causal-diagonal block,
branch grouping and masks (plain ring and all-gather), and the collective byte counter."""
from __future__ import annotations

import math

import torch

from codraft.parallel.comm import Group
from codraft.parallel.ring import Block


def _causal(q0: int, k0: int, n: int) -> Block:
    """Rows q0..q0+n against keys k0..k0+n, causal (row i sees keys <= i)."""
    return Block(slice(q0, q0 + n), slice(k0, k0 + n), None, causal=True)


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


def _check(shard, comm: Group, t: int, kind) -> None:
    if not isinstance(shard, kind):
        raise TypeError(f"this attention needs a {kind.__name__}, got {type(shard).__name__}")
    if shard.plan.world != comm.size or shard.rank != comm.rank:
        raise ValueError(f"shard is rank {shard.rank} of {shard.plan.world}, the CP group is rank {comm.rank} "
                         f"of {comm.size}")
    if t != shard.total:
        raise ValueError(f"k/v have {t} rows, the shard holds {shard.total}")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _count(comm: Group, nbytes: float) -> None:
    comm.sent_bytes += int(nbytes)
