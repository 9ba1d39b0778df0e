"""Attention with soft-capped scores (Gemma 2): every score s becomes cap · tanh(s / cap) before the mask
and the softmax. SDPA has no such step, so the scores are explicit here (T × S per head); the packed
layout still runs one segment at a time (``varlen_attention`` with this as its inner attention).

The softmax runs in fp32 and its weights are cast back to q's dtype, as transformers' eager attention
does. Masks as everywhere in codraft.attention: None (causal, T == S), boolean (True: attend), additive
(a KV-cache step's), or a ``PackedCausal``.
"""
from __future__ import annotations

import functools

import torch

from codraft.attention.dense import PackedCausal
from codraft.attention.varlen import varlen_attention


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, cap: float) -> torch.Tensor:
    """q (B,H,T,D), k/v (B,Hkv,S,D) -> (B,H,T,D), scores scaled by D ** -0.5 and capped at ±cap."""
    if isinstance(mask, PackedCausal):
        return varlen_attention(q, k, v, mask, inner=functools.partial(_capped, cap=cap))
    return _capped(q, k, v, mask, cap)


def _capped(q, k, v, mask, cap: float):
    t, s = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
