"""The target's side of rollout sampling in C (``sampling.c``), at a temperature without top-k /
top-p: a decode step's draw (``sample``: ``Sampler.sample_logits``) and the speculative accept/reject
rule of a verify round (``verify``: ``codraft.spec.verify.verify_drafts``), each from the same
uniforms of the sampler's generator drawn in the same order as the torch code, so a seed gives the
same tokens.

In torch both build the target's whole distribution for every row (log-softmax, exp, an fp64
cumulative sum over the vocabulary): the rule took ~1.9 ms a round at batch 1 and ~10 ms at batch 8
over SmolLM2's 49 152 tokens on a 2-core Xeon, a tenth of a batch-1 verify round; in C 0.33 and 2.0 ms.
Exact as the torch code is: the softmax in fp32 (to a few ulp of torch's), a draft accepted with
probability min(1, p/q), and a token drawn by the inverse CDF in fp64 whose total is the same sum the
search runs through, so the last token of positive weight is always reachable. The rollout engine
uses these where they apply (None elsewhere: greedy, filtering, not CPU fp32, no kernels). Not here:
the rules and their proof (``codraft.spec``).
"""
from __future__ import annotations

import ctypes

import torch

from codraft.kernels import cbuild

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _verify_sampled():
    return cbuild.function("verify_sampled", *[_P] * 5, ctypes.c_float, *[_P] * 4, *[_I] * 3)


def _sample_rows():
    return cbuild.function("sample_rows", *[_P] * 2, ctypes.c_float, *[_P] * 3, *[_I] * 2)


def _applies(sampler, *tensors: torch.Tensor) -> bool:
    return not (sampler.greedy or sampler.top_k or sampler.top_p < 1.0) and cbuild.fits(*tensors) \
        and cbuild.library() is not None


def sample(logits: torch.Tensor, sampler) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``sampler.sample_logits(logits)`` for logits (B,V) -> (tokens (B,), logprobs (B,)), or None where
    this does not apply."""
    if logits.dim() != 2 or not _applies(sampler, logits):
        return None
    b, v = logits.shape
    logits = logits.contiguous()
    u = torch.rand(b, generator=sampler.generator, dtype=torch.float64)  # Sampler.sample's draw
    tokens, logprobs, scratch = torch.empty(b, dtype=torch.int64), torch.empty(b), torch.empty(b * v)
    _sample_rows()(logits.data_ptr(), u.data_ptr(), sampler.temperature, tokens.data_ptr(), logprobs.data_ptr(),
                   scratch.data_ptr(), b, v)
    return tokens, logprobs


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, sampler
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``verify_drafts``' arguments -> its Verdict's (n_accepted (B,), tokens (B,γ+1), logprobs (B,γ+1)),
    or None where this does not apply."""
    if draft_probs is None or not _applies(sampler, target_logits, draft_probs):
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
    _verify_sampled()(logits.data_ptr(), x.data_ptr(), q.data_ptr(), u.data_ptr(), u2.data_ptr(),
                      sampler.temperature, n.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), scratch.data_ptr(),
                      b, g, v)
    return n, tokens, logprobs
