"""Attention that also returns its log-sum-exp, and the exact merge of two partial attentions.

A *partial attention* of queries q_i over a key set S is the pair

    s_ij = scale · q_i·k_j,   ℓ_i = log Σ_{j∈S} exp(s_ij),   O_i = Σ_{j∈S} exp(s_ij − ℓ_i) · v_j.

Attention over a disjoint union S1 ∪ S2 is recovered exactly from the two parts:

    ℓ = log(e^ℓ1 + e^ℓ2),   O = e^(ℓ1−ℓ)·O1 + e^(ℓ2−ℓ)·O2.

An empty key set (a fully masked row) gives ℓ = −inf and O = 0. Merging with an empty part is
the identity; merging two empty parts gives ℓ = −inf, O = 0.

Numerics: everything is computed in fp32 (fp64 inputs stay fp64). Both the softmax and the merge
subtract a row maximum m that is *detached*: the value does not depend on m, so treating it as a
constant gives the exact gradient. An empty row uses m = 0, so the forms (−inf) − (−inf) and
log 0 never appear: forward and backward are NaN-free. Gradients are autograd through these
formulas. That is exact, and it is the rule a hand-written backward must follow: each part's
backward sees the weights e^(ℓk−ℓ), i.e. the merged O and ℓ.

Not here: fused or flash kernels (they return the same (O, ℓ) pair and plug into ``merge_lse``
unchanged), dropout, logit soft-capping.
"""
from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: at least fp32 (bf16/fp16 → fp32, fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def group_queries(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """View (B,H,...,D) queries as (B,Hkv,H/Hkv,...,D): query head h reads KV head h // (H/Hkv)."""
    b, h = q.shape[:2]
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    return q.reshape(b, hkv, h // hkv, *q.shape[2:])


def softmax_with_lse(scores: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim plus its log-sum-exp; ``mask`` (broadcastable, True = keep).

    Returns p (shape of scores; all zero on rows with nothing kept) and lse (scores.shape[:-1];
    −inf on such rows). NaN-free forward and backward.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).detach()  # value-independent shift: detaching is exact
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)  # masked entries: exp(-inf) = 0, gradient 0
    total = e.sum(dim=-1, keepdim=True)
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, float("-inf"), torch.log(total) + m)
    return e / total, lse.squeeze(-1)


def _grouped_mask(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """(B|1, 1|H, T, S) bool → broadcastable to (B, Hkv, g, T, S)."""
    while mask.dim() < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], hkv, g, *mask.shape[2:])


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning (O, LSE), both in ``compute_dtype(q.dtype)``.

    q (B,H,T,D); k, v (B,Hkv,S,D) with H a multiple of Hkv (GQA). ``mask`` bool, broadcastable to
    (B,H,T,S), True = attend. ``causal`` keeps key j for query i iff j ≤ i + S − T (bottom-right
    aligned, so T == S is the usual causal mask); it is ANDed with ``mask``. Returns O (B,H,T,D) and
    LSE (B,H,T); a row with no key gets O = 0, LSE = −inf.
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    dt = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = group_queries(q.to(dt), hkv)  # (B,Hkv,g,T,D)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k.to(dt)) * scale  # (B,Hkv,g,T,S)
    allowed = None if mask is None else _grouped_mask(mask, hkv, h // hkv)
    if causal:
        i = torch.arange(t, device=q.device)[:, None]
        j = torch.arange(s, device=q.device)[None, :]
        tri = j <= i + (s - t)  # (T,S)
        allowed = tri if allowed is None else allowed & tri
    p, lse = softmax_with_lse(scores, allowed)
    o = torch.einsum("bkgts,bksd->bkgtd", p, v.to(dt))  # (B,Hkv,g,T,D)
    return o.reshape(b, h, t, d), lse.reshape(b, h, t)


def merge_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: O (...,D) and LSE (...) in ≥ fp32.

    ℓ = log(e^ℓ1 + e^ℓ2), O = e^(ℓ1−ℓ)·O1 + e^(ℓ2−ℓ)·O2. Either or both ℓ may be −inf (their O must
    then be finite, e.g. 0); forward and backward stay NaN-free.
    """
    dt = compute_dtype(torch.promote_types(o1.dtype, o2.dtype))
    l1, l2 = lse1.to(dt), lse2.to(dt)
    m = torch.maximum(l1, l2).detach()  # value-independent shift: detaching is exact
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)  # in [0,1], the larger is 1 unless both empty
    total = w1 + w2
    empty = total == 0
    total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, float("-inf"), m + torch.log(total))
    o = (w1 / total)[..., None] * o1.to(dt) + (w2 / total)[..., None] * o2.to(dt)
    return o, lse
