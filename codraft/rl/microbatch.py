"""A step's rollouts as M micro-batches whose losses add up to the step's.

The batch is cut at GRPO group boundaries (a group's shared prompt stays packed once), each
micro-batch packed on its own. The RL loss of a micro-batch is normalised by the *step's* token
(or sequence) count (``Totals``), so the micro-batch losses, and their gradients, add up to the
one-batch loss exactly. The draft loss likewise: each micro-batch's numerators are divided by the
step's denominators (``Totals.draft_norm``: the draft's ``loss_normaliser``, e.g. DFlash's supervised
slots per position weight, summed over the micro-batches before any forward by
``with_draft_normaliser``), so its value, gradients and metrics add up to the one-batch step's. That
needs the same anchors at every split: a sequence's are seeded by its index in the step
(``Totals.first``; ``codraft.train.seeding.sequence_seeds``). A draft whose denominators need the
teacher (EAGLE-3 with a draft vocabulary smaller than the target's: positions whose teacher top-1 it
holds) or unseeded anchors keeps its own per micro-batch, weighted by its share of the draft's targets
(completion tokens that follow a completion token): the one-batch loss only approximately.

``merge_metrics`` combines the micro-batches' metrics the same way: sums where the metric is a
share of the step's loss or a count (every draft metric, with the step's draft normaliser), min/max
where it is one, otherwise token-weighted means (RL) or target-weighted means (draft).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from codraft.rl.cotrain import draft_normaliser, replay_routes
from codraft.train.packing import Packed, pack

_SUMS = ("policy/loss", "policy/pg_loss", "policy/num_tokens", "draft/loss")


@dataclass(frozen=True)
class Totals:
    tokens: int          # completion tokens of the whole step (the RL loss's token normaliser)
    sequences: int       # non-empty completions of the whole step (its sequence normaliser)
    draft_weight: float  # this micro-batch's share of the step's draft targets (without draft_norm)
    first: int = 0       # index of its first sequence in the step (seeds the draft's anchors)
    draft_norm: torch.Tensor | None = None  # the step's draft loss denominators (with_draft_normaliser)


@dataclass
class MicroBatch:
    batch: Packed
    advantages: torch.Tensor  # (N_m,)
    totals: Totals | None  # None: the whole step, normalised by its own totals
    replay: torch.Tensor | None = None  # routing replay: (MoE layers, tokens of the policy's layout, k)


def draft_targets(batch: Packed) -> int:
    """Tokens a draft learns to predict from the token before (loss_mask[t] and loss_mask[t+1])."""
    c = batch.completion[0]
    return int((c[1:] & c[:-1]).sum())


def split_microbatches(prompts: list, completions: list, logprobs: list, advantages: torch.Tensor, group_size: int,
                       microbatches: int, device, masks: list | None = None, routes: list | None = None
                       ) -> list[MicroBatch]:
    """The step's N = G·n sequences as ``microbatches`` packed micro-batches of whole groups (``routes``: the
    rollout's per sequence, for routing replay)."""
    groups = len(prompts) // group_size
    if not 1 <= microbatches <= groups:
        raise ValueError(f"parallel.microbatches={microbatches} must be between 1 and the step's {groups} groups "
                         f"(rollout.prompts_per_step)")
    cuts = [groups * i // microbatches * group_size for i in range(microbatches + 1)]
    masks = masks or [None] * len(prompts)
    parts = [pack(prompts[a:b], completions[a:b], logprobs[a:b], device=device, masks=masks[a:b])
             for a, b in zip(cuts, cuts[1:])]
    tokens = sum(int(p.index_mask.sum()) for p in parts)
    sequences = sum(int((p.index_mask.sum(-1) > 0).sum()) for p in parts)
    targets = [draft_targets(p) for p in parts]
    return [MicroBatch(p, advantages[a:b], Totals(max(tokens, 1), max(sequences, 1), t / max(sum(targets), 1), a),
                       None if routes is None else replay_routes(p, routes[a:b]))
            for p, (a, b), t in zip(parts, zip(cuts, cuts[1:]), targets)]


def with_draft_normaliser(mbs: list[MicroBatch], draft, draft_seed: int | None) -> list[MicroBatch]:
    """The micro-batches with the step's draft normaliser in their ``Totals``: the draft's
    ``loss_normaliser`` summed over them (before any forward). As they are where the draft cannot tell
    it from the batch (then each micro-batch's draft loss is normalised alone and weighted)."""
    norms = [draft_normaliser(draft, mb.batch, draft_seed=draft_seed, first=mb.totals.first) for mb in mbs]
    if any(n is None for n in norms):
        return mbs
    step = torch.stack(norms).sum(0)
    return [dataclasses.replace(mb, totals=dataclasses.replace(mb.totals, draft_norm=step)) for mb in mbs]


def merge_metrics(parts: list[dict], mbs: list[MicroBatch]) -> dict:
    """One metrics row from the micro-batches' (see the module doc)."""
    if len(parts) == 1:
        return parts[0]
    tokens = [float(mb.batch.index_mask.sum()) for mb in mbs]
    weights = [mb.totals.draft_weight for mb in mbs]
    shares = mbs[0].totals.draft_norm is not None  # every draft metric is the micro-batch's share or count
    out = {}
    # (a micro-batch without draft targets reports fewer draft metrics: 0, with no weight in them)
    for k in dict.fromkeys(k for p in parts for k in p):
        vals = [p.get(k, 0.0) for p in parts]
        if k.endswith("_min"):
            out[k] = min(vals)
        elif k.endswith("_max"):
            out[k] = max(vals)
        elif shares and k.startswith("draft/"):
            out[k] = sum(vals)
        elif k == "draft/loss":
            out[k] = sum(w * v for w, v in zip(weights, vals))
        elif k in _SUMS:
            out[k] = sum(vals)
        elif k.startswith("draft/"):
            out[k] = sum(w * v for w, v in zip(weights, vals)) / max(sum(weights), 1e-12)
        else:
            out[k] = sum(n * v for n, v in zip(tokens, vals)) / max(sum(tokens), 1.0)
    return out
