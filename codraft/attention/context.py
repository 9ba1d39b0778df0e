"""The main attention context: the one way a draft's training loss reaches the main packed row.

Draft losses attend from their own queries (EAGLE-3 TTT steps, DFlash/DSpark blocks) into the
policy's packed row. Under context parallelism (CP) that row is split across ranks: a rank holds
the features of some of its positions only, in its own order, plus padding rows, while the
token-level metadata (ids, loss mask, cu_seqlens, teacher logits) stays global. So the drafts
never attend with ``cu_seqlens`` themselves: they go through a ``MainAttention``, and the ring
(``codraft.parallel``, which may import this; never the other way round) is a subclass.

What a subclass must keep:

* ``rows`` / ``local_index`` / ``positions`` translate between local feature rows and global
  packed positions. They are local: no communication.
* ``causal``, ``branch`` and ``total`` are collective under CP. The drafts call them in the same
  order on every rank, whatever the rank holds (a rank may have no branch at all: N = 0), so a
  subclass may rely on that order.
* ``total(x)`` is the sum over ranks whose gradient reaches the local ``x`` only. Drafts divide
  ``total(numerator)`` by a global denominator: every rank computes the same loss value, and
  each rank's parameter gradient is its own share of the full gradient (sum them over the CP
  group, do not average).

This base class is the single-process case: every row is local, in packed order.
"""
from __future__ import annotations

import torch

from codraft.attention.branch import branch_main_part
from codraft.attention.dense import positions_from_cu_seqlens
from codraft.attention.merge import compute_dtype


class MainAttention:
    """How draft queries reach the main (packed) sequence during training. This base class is the
    single-process case: every row of the packed row is local."""

    def __init__(self, cu_seqlens: torch.Tensor, total: int):
        self.cu_seqlens = cu_seqlens.to(torch.long)
        self.length = int(total)  # T, the global packed row (``total`` is the cross-rank sum below)
        # (T_l,) global packed position of each local feature row, -1 = a padding row (CP only)
        self.rows = torch.arange(self.length, device=self.cu_seqlens.device)

    @property
    def num_ranks(self) -> int:
        """Ranks the row is split over. Drafts use it only to skip work that pays off under CP."""
        return 1

    def local_index(self, g: torch.Tensor) -> torch.Tensor:
        """Global positions (any shape, in [0, T)) -> local row index, -1 where not held here."""
        return g

    def positions(self) -> torch.Tensor:
        """(T_l,) RoPE position of each local row inside its sequence (padding rows: any finite value)."""
        return positions_from_cu_seqlens(self.cu_seqlens, self.length)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Main causal part at the local rows: q (B,H,T_l,D), k/v (B,Hkv,T_l,D) -> O (B,H,T_l,D),
        LSE (B,H,T_l), fp32. Row i sees the keys of its sequence at global positions <= its own."""
        o, lse = branch_main_part(q[:, :, :, None], k, v, None, include_anchor=True, cu_seqlens=self.cu_seqlens)
        return o[:, :, :, 0], lse[..., 0]

    def branch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor, *,
               include_anchor: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Main part of branches anchored at LOCAL rows ``anchors`` (N,): q (B,H,N,Gq,D) over the main
        k/v (B,Hkv,T_l,D) -> O (B,H,N,Gq,D), LSE (B,H,N,Gq), fp32. N may be 0 (a rank without branches)."""
        if q.shape[2] == 0:
            dt = compute_dtype(q.dtype)
            return q.new_zeros(q.shape, dtype=dt), q.new_full(q.shape[:-1], float("-inf"), dtype=dt)
        return branch_main_part(q, k, v, anchors, include_anchor=include_anchor, cu_seqlens=self.cu_seqlens)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over all ranks, gradient flowing to the local ``x`` only."""
        return x


__all__ = ["MainAttention"]
