"""DSpark's proposal loop for the vanilla Markov head in one C call (``markov.c``): for each of the γ
slots, the transition bias W2·W1[previous token] added to the slot's base logits, then the token drawn
(or the argmax when greedy), every row at once.

In torch the loop is ~10 small ops per slot, each a dispatch: at batch 1 they cost more than the
draft's layer. Exact as the torch loop is: q is the distribution the token was drawn from (softmax at
the sampler's temperature; fp32 to a few ulp of torch's), drawn by the same inverse CDF in fp64 from
the same uniforms of the sampler's generator, in the same order, so a seed gives the same tokens.
Installed from outside: ``codraft.kernels.enable`` sets a DSpark draft's ``fused_markov`` hook to
``propose``. Not here: top-k / top-p filtering (the torch loop runs them), the gated head.
"""
from __future__ import annotations

import ctypes

import torch

from codraft.kernels import cbuild

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _kernel():
    return cbuild.function("markov_propose", *[_P] * 5, ctypes.c_float, *[_P] * 3, *[_I] * 4)


def propose(base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, sampler
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """base (B,G,K) fp32 base logits, prev (B,) the row of W1 (R,r) before slot 0, W2 (K,r); ``sampler``
    a ``codraft.spec.sampling.Sampler`` -> (tokens (B,G) draft indices, q (B,G,K), None when greedy), or
    None where this does not apply (filtering, not CPU fp32 without autograd, no kernels)."""
    if sampler.top_k or sampler.top_p < 1.0 or not cbuild.fits(base, w1, w2) or _kernel() is None:
        return None
    b, g, k = base.shape
    if w2.shape != (k, w1.shape[1]) or prev.shape != (b,):
        raise ValueError(f"markov: base {tuple(base.shape)}, prev {tuple(prev.shape)}, W1 {tuple(w1.shape)}, "
                         f"W2 {tuple(w2.shape)} do not fit (B,G,K), (B,), (R,r), (K,r)")
    base, w1, w2 = base.contiguous(), w1.contiguous(), w2.contiguous()
    prev = prev.to(torch.int64).contiguous()
    tokens = torch.empty(b, g, dtype=torch.int64)
    greedy = sampler.greedy
    q = None if greedy else torch.empty_like(base)
    # the torch loop draws B uniforms per slot, slot after slot: the same numbers in the same order
    u = None if greedy else torch.rand(g, b, generator=sampler.generator, dtype=torch.float64).T.contiguous()
    scratch = torch.empty(b * k)
    _kernel()(base.data_ptr(), w1.data_ptr(), w2.data_ptr(), prev.data_ptr(), None if greedy else u.data_ptr(),
              sampler.temperature, None if greedy else q.data_ptr(), tokens.data_ptr(), scratch.data_ptr(), b, g, k,
              w1.shape[1])
    return tokens, q
