"""Rollout generation: batched static-cache decoding with lossless speculative verification.

``Engine(model, draft=None, gamma=None, *, max_len=None).generate(prompts, max_new_tokens, ...)``
returns ``GenerationResult``s (new tokens, target logprobs); ``engine.stats`` holds the
acceptance and timing figures of the last call. ``gamma="auto"`` sizes each round's drafts to the
live batch (``draft_length``).
"""
from codraft.rollout.draft_length import AcceptanceEstimate, CostModel, choose, load_or_calibrate
from codraft.rollout.engine import Engine, GenerationResult, Rollout
from codraft.spec.sampling import Sampler, filter_logits
from codraft.rollout.stats import SpecStats
from codraft.spec.verify import Verdict, verify_drafts

__all__ = ["AcceptanceEstimate", "CostModel", "choose", "load_or_calibrate", "Engine", "GenerationResult", "Rollout",
           "Sampler", "filter_logits", "SpecStats", "Verdict", "verify_drafts"]
