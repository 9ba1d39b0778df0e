"""A co-training step's view of its packed row under context parallelism.

``ShardedRow`` runs the policy on this rank's zigzag rows (ring attention as the model's
attention function, positions from the shard) and translates between the global rows the
losses are written in and the local rows the rank holds:

* ``select(rows)``: which of the global rows (e.g. the R rows whose next token is a completion
  token) are held here, and where;
* ``assemble(x, live)``: the full (R, ...) tensor from every rank's share, equal on every rank,
  whose gradient reaches only this rank's entries. A loss written over the full tensor then has
  the same value everywhere, and summing the ranks' parameter gradients gives its exact
  gradient, whatever the loss (GRPO's normalisations, the KL term, the metrics) — including the
  parts that reach other ranks' activations, which the ring's backward carries back to them;
* ``main``: the drafts' ``MainAttention`` over the same shard (``RingMain``).

``sync_gradients`` sums the ranks' gradients afterwards (one flat all-reduce per model).
Shared prompts stay shared for the policy; the drafts' per-sequence rows are made from its taps
(``ShardedRow`` says how).
"""
from __future__ import annotations

import hashlib

import torch

from codraft.attention import PackedCausal
from codraft.attention.context import MainAttention
from codraft.parallel.comm import Group, PeerError
from codraft.models.layers import whole
from codraft.parallel.ring import RingAttention, ring_attention, ring_branch_attention
from codraft.parallel.zigzag import ZigzagPlan, ZigzagShard


def sum_across(x: torch.Tensor, comm: Group, what: str = "a loss term") -> torch.Tensor:
    """Σ_ranks x with the gradient flowing to the local x only (value equal on every rank)."""
    total = comm.all_reduce(x.detach().clone(), what)
    return x + (total - x.detach())


class RingMain(MainAttention):
    """The drafts' main attention over a zigzag shard: causal and branch parts travel the ring."""

    def __init__(self, shard: ZigzagShard, comm: Group, cu_seqlens: torch.Tensor):
        super().__init__(cu_seqlens, shard.plan.total)
        self.shard, self.comm = shard, comm
        self.rows = shard.index
        self._local = _local_index(self.rows, self.length)

    @property
    def num_ranks(self) -> int:
        return self.comm.size

    def local_index(self, g: torch.Tensor) -> torch.Tensor:
        return self._local[g]

    def positions(self) -> torch.Tensor:
        return self.shard.positions()

    def causal(self, q, k, v):
        return ring_attention(q, k, v, self.shard, self.comm)

    def branch(self, q, k, v, anchors, *, include_anchor: bool):
        return ring_branch_attention(q, k, v, anchors, self.shard, self.comm, include_anchor=include_anchor)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        return sum_across(x, self.comm, "a draft loss term")


class ShardedRow:
    """One packed batch (``codraft.train.packing.Packed``: ids, cu_seqlens, optional shared-prompt
    layout) split over the CP group: the context-parallel ``codraft.rl.cotrain.Row``.

    The policy runs on the shared-prompt layout when there is one (``batch.shared``: each group's
    prompt once, zigzag.py), the drafts on the per-sequence layout they train on: their taps are
    all-gathered (detached, (T_shared, H) per tap), expanded per sequence and re-sharded, as the
    single-process step expands them. Without shared prompts both use one plan and nothing moves.
    """

    def __init__(self, batch, comm: Group):
        self.comm, self.batch = comm, batch
        t, sh, dev = batch.input_ids.shape[1], batch.shared, batch.input_ids.device
        layout = sh.layout if sh is not None else PackedCausal.of(batch.cu_seqlens, t)
        self.ids = sh.input_ids if sh is not None else batch.input_ids
        self.plan = ZigzagPlan.of_layout(layout, comm.size)
        _check_same_row(self.plan, self.ids, comm)
        self.shard = ZigzagShard(self.plan, comm.rank, dev)
        self.attention = RingAttention(comm)
        self.draft_plan = self.plan if sh is None else ZigzagPlan.of(batch.cu_seqlens, comm.size, t)
        draft_shard = self.shard if sh is None else ZigzagShard(self.draft_plan, comm.rank, dev)
        self.main = RingMain(draft_shard, comm, batch.cu_seqlens)
        self._local = _local_index(self.shard.index, self.plan.total)

    def model_inputs(self) -> tuple[torch.Tensor, dict]:
        """This rank's ids of the policy's layout and the keywords that run the model on them."""
        return self.plan.shard(self.ids, self.comm.rank), {"layout": self.shard, "attention": self.attention}

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A tensor over the policy layout's tokens (along ``dim``) at this rank's rows (padding: −1)."""
        return self.plan.shard(x, self.comm.rank, dim=dim, fill=-1)

    def draft_features(self, feats: dict) -> dict:
        """Taps at this rank's rows of the policy's layout -> detached, at its rows of the drafts'."""
        if self.batch.shared is None:
            return {l: f.detach() for l, f in feats.items()}
        return {l: self._to_draft_rows(f.detach(), l) for l, f in feats.items()}

    def forward(self, model, taps: tuple[int, ...] | None):
        """The model's last-layer output (1,T_l,H) at this rank's rows of the policy's layout, and its
        taps {l: (1,T_l',H)} at this rank's rows of the drafts' layout (detached)."""
        ids, kw = self.model_inputs()
        out = model(ids, taps=taps, head=False, **kw)
        hidden, feats = out if taps is not None else (out, {})
        return whole(hidden), self.draft_features({l: whole(f) for l, f in feats.items()})

    def _to_draft_rows(self, f: torch.Tensor, layer: int) -> torch.Tensor:
        parts = self.comm.all_gather(f.contiguous(), f"the taps of layer {layer}")
        full = self.plan.unshard(parts)[:, self.batch.shared.gather]  # (1,T,H) per sequence
        return self.draft_plan.shard(full, self.comm.rank)

    def select(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows (R,) per-sequence positions -> (local rows of the policy's output for those held here
        (R_l,), live (R,) bool: held here)."""
        sh = self.batch.shared
        local = self._local[sh.gather[rows] if sh is not None else rows]
        live = local >= 0
        return local[live], live

    def assemble(self, x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """This rank's values x (R_l, ...) of the live rows -> the full (R, ...) (see module doc)."""
        full = x.new_zeros(live.shape[0], *x.shape[1:])
        full[live] = x.detach()
        self.comm.all_reduce(full, "per-token values")  # every row is held by exactly one rank
        if not x.requires_grad:
            return full
        return full.index_put((live.nonzero()[:, 0],), x)

    def mean(self, m: torch.Tensor, n: int) -> torch.Tensor:
        """The mean over all ranks' rows of this rank's mean ``m`` over its ``n`` rows (metrics)."""
        both = torch.stack([m.detach().float() * n, torch.tensor(float(n), device=m.device)])
        self.comm.all_reduce(both, "a metric")
        return both[0] / both[1].clamp_min(1)

def _local_index(index: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) local row of each global position, −1 where another rank holds it."""
    held = (index >= 0).nonzero()[:, 0]
    out = torch.full((total,), -1, dtype=torch.long, device=index.device)
    out[index[held]] = held
    return out


def _check_same_row(plan: ZigzagPlan, input_ids: torch.Tensor, comm: Group) -> None:
    """Every rank must shard the same row: a mismatch is an error naming the ranks, not a hang or
    silently wrong attention."""
    digest = hashlib.sha256(input_ids.detach().cpu().numpy().tobytes()).hexdigest()[:16]
    seen = comm.all_gather_object((plan.bounds, digest), "the packed row's cu_seqlens")
    for r, (bounds, d) in enumerate(seen):
        if bounds != plan.bounds:
            raise PeerError(f"CP rank {comm.rank}: CP rank {r} packed a different row: cu_seqlens {list(bounds)} "
                            f"vs {list(plan.bounds)} here; every CP rank must train on the same batch")
        if d != digest:
            raise PeerError(f"CP rank {comm.rank}: CP rank {r} packed different tokens (same cu_seqlens); every "
                            f"CP rank must train on the same batch")
