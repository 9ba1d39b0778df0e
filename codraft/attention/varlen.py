"""Attention for the packed layout, one causal SDPA per sequence instead of one masked T×T SDPA.

A packed training row of T tokens holding N sequences needs only the N causal blocks on the
diagonal of the T×T score matrix; with 8 sequences of ~150 tokens that is ~1/8 of the square.
The dense masked SDPA (``sdpa`` with ``PackedCausal.dense()``) cannot skip the masked blocks, so
here q/k/v are split into sequences by ``PackedCausal.bounds`` and run through SDPA with
``is_causal=True``. Padding tail tokens attend only to themselves, as in the dense mask, so their
output is their own value (softmax of a single score is exactly 1).

A segment with a prefix (``PackedCausal.prefix``: a completion that sees its GRPO group's prompt,
packed once) runs one SDPA over keys [prefix ; own segment] with a small explicit mask.

A layout with a sliding ``window`` (a model's sliding layers) gives a segment longer than the window
a banded mask in place of ``is_causal``; ``inner`` is the attention each segment runs (``sdpa``;
soft-capped attention passes its own).

Results equal the dense path up to float rounding (tested, outputs and gradients). Any other
mask (None, a dense tensor for KV-cache decode) goes to ``inner`` unchanged.
"""
from __future__ import annotations

import torch

from codraft.attention.dense import PackedCausal, sdpa, sliding_causal_mask


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | PackedCausal | None = None, inner=sdpa) -> torch.Tensor:
    """``attn(q, k, v, mask)``: q (B,H,T,D), k/v (B,Hkv,T,D); per-sequence causal SDPA for ``PackedCausal``."""
    if not isinstance(mask, PackedCausal):
        return inner(q, k, v, mask)
    t = q.shape[2]
    if k.shape[2] != t or mask.total != t:
        raise ValueError(f"packed attention needs T == S == mask.total, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, total {mask.total}")
    # Split once: the backward of one split is one cat, while N separate slices would each
    # backpropagate through a zero-filled (B,H,T,D) gradient (quadratic in the number of sequences).
    tail = mask.bounds[-1]
    sizes = [e - s for s, e in zip(mask.bounds[:-1], mask.bounds[1:])] + [t - tail]
    qs, ks, vs = q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)
    parts, w = [], mask.window
    for i, n in enumerate(sizes[:-1]):
        if n == 0:  # empty segments own no rows
            continue
        p = mask.prefix_of(i)
        if p < 0:
            band = None if w is None or n <= w else sliding_causal_mask(n, w, q.device)
            parts.append(inner(qs[i], ks[i], vs[i], band))  # causal (sdpa keeps cuDNN off: a plan per shape)
            continue
        # keys [prefix ; own]: every query sees the whole prefix, then its own segment causally.
        # Autograd through the cat sums the prefix's dK/dV over every segment that shares it.
        m = sizes[p]
        allowed = torch.ones(n, m + n, dtype=torch.bool, device=q.device)
        allowed[:, m:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if w is not None:  # query j sits at position m + j, key l at position l
            allowed &= (m + torch.arange(n, device=q.device))[:, None] - torch.arange(m + n, device=q.device) < w
        kk, vv = torch.cat([ks[p], ks[i]], dim=2), torch.cat([vs[p], vs[i]], dim=2)
        parts.append(inner(qs[i], kk, vv, allowed))
    if tail < t:  # padding: each token sees only itself, so its output is its value (head h reads KV head h // g)
        parts.append(vs[-1].repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype))
    return torch.cat(parts, dim=2)
