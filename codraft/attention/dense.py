"""Dense attention with explicit boolean masks (the reference every other path is tested against)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads. mask None means causal (T == S)."""
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
