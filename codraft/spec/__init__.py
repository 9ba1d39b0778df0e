"""Speculative sampling: the sampler's logits transform, and the lossless verify rule.

Below both the rollout engine (which runs it) and the drafts (which sample their proposals
with the same ``Sampler``); it depends on torch only.
"""
from codraft.spec.sampling import Sampler, filter_logits
from codraft.spec.verify import Verdict, verify_drafts

__all__ = ["Sampler", "filter_logits", "Verdict", "verify_drafts"]
