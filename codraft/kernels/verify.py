"""The speculative accept/reject rule of a sampled verify in one C call (``verify.c``): what
``codraft.spec.verify.verify_drafts`` computes at a temperature without top-k / top-p, from the same
uniforms of the sampler's generator drawn in the same order, so a seed gives the same tokens.

In torch the rule builds the target's whole distribution for every slot (log-softmax, exp, an fp64
cumulative sum over the vocabulary): ~2 ms a round at batch 1 and ~18 ms at batch 8 over SmolLM2's
49 152 tokens on a 2-core Xeon, a tenth of a batch-1 verify round. Exact as the torch rule is: the
draft is accepted with probability min(1, p/q) and the residual max(0, p − q) is drawn by the inverse
CDF in fp64 whose total is the same sum the search runs through (softmax in fp32, to a few ulp of
torch's). The rollout engine uses it where it applies (``run`` returns None elsewhere: greedy,
filtering, not CPU fp32, no kernels). Not here: the rule and its proof (``codraft.spec.verify``).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from codraft.kernels import cbuild

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _kernel():
    lib = cbuild.library()
    if lib is None:
        return None
    fn = lib.verify_sampled
    fn.restype, fn.argtypes = None, [_P] * 5 + [ctypes.c_float] + [_P] * 4 + [_I] * 3
    return fn


def run(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, sampler
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``verify_drafts``' arguments -> its Verdict's (n_accepted (B,), tokens (B,γ+1), logprobs (B,γ+1)),
    or None where this does not apply."""
    if sampler.greedy or sampler.top_k or sampler.top_p < 1.0 or draft_probs is None \
            or not cbuild.fits(target_logits, draft_probs) or _kernel() is None:
        return None
    b, g = draft_tokens.shape
    v = target_logits.shape[-1]
    if target_logits.shape != (b, g + 1, v) or draft_probs.shape != (b, g, v):
        raise ValueError(f"verify: logits {tuple(target_logits.shape)}, drafts {tuple(draft_tokens.shape)}, q "
                         f"{tuple(draft_probs.shape)} do not fit (B,γ+1,V), (B,γ), (B,γ,V)")
    logits, q = target_logits.contiguous(), draft_probs.contiguous()
    x = draft_tokens.to(torch.int64).contiguous()
    u = sampler.uniform((b, g), device=logits.device).contiguous()  # verify_drafts' draws, in its order
    u2 = torch.rand(b, generator=sampler.generator, dtype=torch.float64)
    n, tokens = torch.empty(b, dtype=torch.int64), torch.empty(b, g + 1, dtype=torch.int64)
    logprobs, scratch = torch.empty(b, g + 1), torch.empty(b * v)
    _kernel()(logits.data_ptr(), x.data_ptr(), q.data_ptr(), u.data_ptr(), u2.data_ptr(), sampler.temperature,
              n.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), scratch.data_ptr(), b, g, v)
    return n, tokens, logprobs
