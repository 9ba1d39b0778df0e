"""A block draft's training anchors: which packed positions start a block (notes 2.2).

``sample_anchors`` draws at most ``num_anchors`` random anchors per packed sequence, among the
positions whose block has a first label (``Blocks``: the anchors, their sequences' ends, their
positions inside them). Under context parallelism the anchors are drawn from the global row (the
same on every rank) and each rank trains the blocks whose anchor row it holds (``held_blocks``).

Not here: the blocks' forward and losses (block_backbone.py, dflash.py, dspark.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from codraft.drafts.batch import DraftBatch


class Blocks(NamedTuple):
    """Training anchors of one packed row, N blocks kept (sorted by packed index)."""
    anchors: torch.Tensor  # (N,) packed index a_n
    seq_end: torch.Tensor  # (N,) packed index one past a_n's sequence
    pos: torch.Tensor  # (N,) position of a_n inside its sequence (RoPE position of slot 0)


def sample_anchors(batch: DraftBatch, num_anchors: int, *, label_offset: int,
                   generator: torch.Generator | None = None) -> Blocks:
    """Random anchors, at most ``num_anchors`` per packed sequence (notes 2.2).

    a is valid when a and a + label_offset lie in the same sequence and both are loss tokens
    (the anchor is a completion token, as the pending token always is at decode time, and the
    first supervised slot has a label). Scores: ``batch.uniforms`` (per-sequence seeds when the batch
    has them: the same anchors at every layout; else redrawn per call, ``generator`` repeats them).
    """
    cu, lm = batch.cu_seqlens.to(batch.device, torch.long), batch.loss_mask[0]
    t, n_seq = lm.shape[0], cu.shape[0] - 1
    idx = torch.arange(t, device=lm.device)
    seq = torch.searchsorted(cu[1:], idx, right=True)  # (T,) sequence id, padding -> n_seq
    end = torch.cat([cu[1:], cu[-1:]])[seq]  # (T,) one past the sequence (padding: cu[-1])
    nxt = (idx + label_offset).clamp(max=t - 1)
    valid = lm & lm[nxt] & (idx + label_offset < end)
    score = batch.uniforms(generator).to(lm.device)  # [0,1)
    key = seq.double() * 4 + torch.where(valid, score.double(), torch.full_like(score, 2.0).double())
    order = torch.argsort(key)  # sequence s occupies sorted slots cu[s]..cu[s+1]-1, valid ones first
    r = torch.arange(num_anchors, device=lm.device)
    at = cu[:-1, None] + r  # (n_seq,N)
    chosen = order[at.clamp(max=t - 1)]
    keep = (at < cu[1:, None]) & valid[chosen]
    a = chosen[keep].sort().values  # (N,) one host sync: training only
    return Blocks(a, end[a], a - cu[seq[a]])


def held_blocks(batch: DraftBatch, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks this rank trains, those whose anchor row it holds (all of them without context
    parallelism): (sel (N_l,) indices into ``blocks``, ascending; their anchors' local rows (N_l,)).
    One host sync."""
    local = batch.context.local_index(blocks.anchors.to(batch.device))
    sel = (local >= 0).nonzero()[:, 0]
    return sel, local[sel]


__all__ = ["Blocks", "held_blocks", "sample_anchors"]
