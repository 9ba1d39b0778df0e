"""Dense attention with explicit boolean masks (the reference every other path is tested against)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's SDPA builds an execution plan per shape, and a decode step's key length changes every step:
# ~1.8 ms of host time per call, decoding 3x slower in bf16 on an H200 (scripts/device_check.py)
_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class PackedCausal:
    """The packed layout's mask, described instead of materialised: causal within each segment.

    One row of T tokens holds segments delimited by ``cu_seqlens``; tokens at or after
    cu_seqlens[-1] (padding) attend only to themselves. ``bounds`` is a host copy of cu_seqlens,
    taken once per forward, so attention functions can slice per segment without syncing per layer.

    ``prefix`` (optional, one entry per segment) lets segment i also see every token of an
    earlier segment ``prefix[i]`` (-1: none), as if that segment preceded it: a GRPO group's
    completions each see their shared prompt, packed once. RoPE positions of segment i then
    continue after its prefix (``positions()``). A prefix segment has no prefix itself.

    ``window`` (optional): sliding-window attention, a query at RoPE position p sees keys at positions
    p - window + 1 .. p only (a model's sliding layers; ``dataclasses.replace(layout, window=w)``).

    ``dense()`` is the equivalent (1,1,T,T) boolean mask.
    """
    cu_seqlens: torch.Tensor
    total: int
    bounds: tuple[int, ...]
    prefix: tuple[int, ...] = ()
    window: int | None = None

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, total: int, prefix: tuple[int, ...] = ()) -> "PackedCausal":
        bounds = tuple(int(x) for x in cu_seqlens.tolist())  # one host sync per forward
        if bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds[:-1])) or bounds[-1] > total:
            raise ValueError(f"cu_seqlens must start at 0, not decrease and end <= {total}; got {list(bounds)}")
        prefix = tuple(int(p) for p in prefix)
        if prefix and (len(prefix) != len(bounds) - 1
                       or any(not -1 <= p < i or (p >= 0 and prefix[p] != -1) for i, p in enumerate(prefix))):
            raise ValueError(f"prefix needs one entry per segment, each -1 or an earlier segment without a "
                             f"prefix; got {list(prefix)} for {len(bounds) - 1} segments")
        return cls(cu_seqlens, total, bounds, prefix)

    def prefix_of(self, segment: int) -> int:
        return self.prefix[segment] if self.prefix else -1

    def positions(self) -> torch.Tensor:
        """(T,) RoPE positions: restart at every segment, continuing after the segment's prefix."""
        pos = positions_from_cu_seqlens(self.cu_seqlens, self.total)
        if not any(p >= 0 for p in self.prefix):
            return pos
        shift = [self.bounds[p + 1] - self.bounds[p] if p >= 0 else 0 for p in self.prefix] + [0]  # padding: 0
        seg = torch.searchsorted(self.cu_seqlens[1:], torch.arange(self.total, device=pos.device), right=True)
        return pos + torch.tensor(shift, device=pos.device)[seg]

    def longest(self) -> int:
        """The most keys a query may see: the longest segment with its prefix (a window shorter than this
        changes the attention)."""
        return max((e - s + (self.bounds[p + 1] - self.bounds[p] if p >= 0 else 0)
                    for p, s, e in zip(self.prefix or [-1] * (len(self.bounds) - 1), self.bounds, self.bounds[1:])),
                   default=0)

    def dense(self) -> torch.Tensor:
        mask = varlen_causal_mask(self.cu_seqlens, self.total)
        if any(p >= 0 for p in self.prefix):
            idx = torch.arange(self.total, device=self.cu_seqlens.device)
            seg = torch.searchsorted(self.cu_seqlens[1:], idx, right=True)  # (T,) segment id, padding -> S
            pre = torch.tensor(list(self.prefix) + [-1], device=idx.device)[seg]  # (T,) prefix segment of each query
            sees_prefix = (seg[None, :] == pre[:, None]) & (pre[:, None] >= 0)
            mask = mask | sees_prefix[None, None]
        if self.window is not None:  # within what a query sees, only the last `window` positions
            pos = self.positions()
            mask = mask & (pos[:, None] - pos[None, :] < self.window)[None, None]
        return mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         mask: torch.Tensor | PackedCausal | None = None) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads. mask None means causal (T == S).

    A ``PackedCausal`` mask is materialised as its dense T×T mask: this is the reference for
    ``varlen_attention``, not the fast path.
    """
    if isinstance(mask, PackedCausal):
        mask = mask.dense()
    with sdpa_kernel(_NOT_CUDNN) if q.is_cuda else contextlib.nullcontext():
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


def cache_causal_mask(lengths: torch.Tensor, t: int, span: int, window: int | None = None) -> torch.Tensor:
    """(B,1,T,S) mask for T new tokens written at lengths[b] + i into a cache read up to ``span``;
    ``window``: each sees only the last ``window`` positions, its own included (sliding-window layers)."""
    q_pos = lengths[:, None] + torch.arange(t, device=lengths.device)  # (B,T)
    k_pos = torch.arange(span, device=lengths.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask = mask & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    return mask[:, None]


def sliding_causal_mask(t: int, window: int, device=None) -> torch.Tensor:
    """(1,1,T,T) causal mask where token i sees tokens i - window + 1 .. i."""
    idx = torch.arange(t, device=device)
    d = idx[:, None] - idx[None, :]
    return ((d >= 0) & (d < window))[None, None]
