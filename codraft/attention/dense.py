"""Dense attention with explicit boolean masks (the reference every other path is tested against)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedCausal:
    """The packed layout's mask, described instead of materialised: causal within each sequence.

    One row of T tokens holds sequences delimited by ``cu_seqlens``; tokens at or after
    cu_seqlens[-1] (padding) attend only to themselves. ``bounds`` is a host copy of cu_seqlens,
    taken once per forward, so attention functions can slice per sequence without syncing per layer.
    ``dense()`` is the equivalent (1,1,T,T) boolean mask.
    """
    cu_seqlens: torch.Tensor
    total: int
    bounds: tuple[int, ...]

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, total: int) -> "PackedCausal":
        bounds = tuple(int(x) for x in cu_seqlens.tolist())  # one host sync per forward
        if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])) or bounds[-1] > total:
            raise ValueError(f"cu_seqlens must start at 0, not decrease and end <= {total}; got {list(bounds)}")
        return cls(cu_seqlens, total, bounds)

    def dense(self) -> torch.Tensor:
        return varlen_causal_mask(self.cu_seqlens, self.total)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: torch.Tensor | PackedCausal | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads. mask None means causal (T == S).

    A ``PackedCausal`` mask is materialised as its dense T×T mask: this is the reference for
    ``varlen_attention``, not the fast path.
    """
    if isinstance(mask, PackedCausal):
        mask = mask.dense()
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Positions that restart at 0 at every packed sequence start: (total,)."""
    idx = torch.arange(total, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens[1:], idx, right=True)  # segment id per token
    return idx - cu_seqlens[seg]


def varlen_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1,1,T,T) mask: causal within each packed sequence, nothing across sequences.

    Tokens after cu_seqlens[-1] (padding) attend only to themselves, so no row is empty.
    """
    idx = torch.arange(total, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens, idx, right=True)  # padding gets its own segment
    same = seg[:, None] == seg[None, :]
    causal = idx[:, None] >= idx[None, :]
    pad = idx >= cu_seqlens[-1]
    diag = torch.eye(total, dtype=torch.bool, device=idx.device)
    mask = (same & causal & ~pad[:, None]) | (pad[:, None] & diag)
    return mask[None, None]


def cache_causal_mask(lengths: torch.Tensor, t: int, span: int) -> torch.Tensor:
    """(B,1,T,S) mask for T new tokens written at lengths[b] + i into a cache read up to ``span``."""
    q_pos = lengths[:, None] + torch.arange(t, device=lengths.device)  # (B,T)
    k_pos = torch.arange(span, device=lengths.device)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]
