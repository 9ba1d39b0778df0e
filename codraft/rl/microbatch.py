"""A step's rollouts as M micro-batches whose losses add up to the step's.

The batch is cut at GRPO group boundaries (a group's shared prompt stays packed once), each
micro-batch packed on its own. The RL loss of a micro-batch is normalised by the *step's* token
(or sequence) count (``Totals``), so the micro-batch losses, and their gradients, add up to the
one-batch loss exactly. The draft loss is a mean over the anchors each micro-batch draws; the
step's draft loss weighs micro-batch m by its share of the draft's targets (completion tokens
that follow a completion token), which is the one-batch loss in expectation over the anchors.

``merge_metrics`` combines the micro-batches' metrics the same way: sums where the metric is a
share of the step's loss or a count, min/max where it is one, otherwise token-weighted means
(RL) or target-weighted means (draft).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from codraft.train.packing import Packed, pack

_SUMS = ("policy/loss", "policy/pg_loss", "policy/num_tokens", "draft/loss")


@dataclass(frozen=True)
class Totals:
    tokens: int          # completion tokens of the whole step (the RL loss's token normaliser)
    sequences: int       # non-empty completions of the whole step (its sequence normaliser)
    draft_weight: float  # this micro-batch's share of the step's draft targets


@dataclass
class MicroBatch:
    batch: Packed
    advantages: torch.Tensor  # (N_m,)
    totals: Totals


def draft_targets(batch: Packed) -> int:
    """Tokens a draft learns to predict from the token before (loss_mask[t] and loss_mask[t+1])."""
    c = batch.completion[0]
    return int((c[1:] & c[:-1]).sum())


def split_microbatches(prompts: list, completions: list, logprobs: list, advantages: torch.Tensor, group_size: int,
                       microbatches: int, device) -> list[MicroBatch]:
    """The step's N = G·n sequences as ``microbatches`` packed micro-batches of whole groups."""
    groups = len(prompts) // group_size
    if not 1 <= microbatches <= groups:
        raise ValueError(f"parallel.microbatches={microbatches} must be between 1 and the step's {groups} groups "
                         f"(rollout.prompts_per_step)")
    cuts = [groups * i // microbatches * group_size for i in range(microbatches + 1)]
    parts = [pack(prompts[a:b], completions[a:b], logprobs[a:b], device=device) for a, b in zip(cuts, cuts[1:])]
    tokens = sum(int(p.index_mask.sum()) for p in parts)
    sequences = sum(int((p.index_mask.sum(-1) > 0).sum()) for p in parts)
    targets = [draft_targets(p) for p in parts]
    return [MicroBatch(p, advantages[a:b], Totals(max(tokens, 1), max(sequences, 1), t / max(sum(targets), 1)))
            for p, (a, b), t in zip(parts, zip(cuts, cuts[1:]), targets)]


def merge_metrics(parts: list[dict], mbs: list[MicroBatch]) -> dict:
    """One metrics row from the micro-batches' (see the module doc)."""
    if len(parts) == 1:
        return parts[0]
    tokens = [float(mb.batch.index_mask.sum()) for mb in mbs]
    weights = [mb.totals.draft_weight for mb in mbs]
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        if k.endswith("_min"):
            out[k] = min(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif k == "draft/loss":
            out[k] = sum(w * v for w, v in zip(weights, vals))
        elif k in _SUMS:
            out[k] = sum(vals)
        elif k.startswith("draft/"):
            out[k] = sum(w * v for w, v in zip(weights, vals)) / max(sum(weights), 1e-12)
        else:
            out[k] = sum(n * v for n, v in zip(tokens, vals)) / max(sum(tokens), 1.0)
    return out
