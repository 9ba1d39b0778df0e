"""Step 2 of an RL step (``Trainer.score``): the run's reward functions score each completion
(``codraft.rewards``: a built-in task's own reward, or ``reward.funcs``; a multi-turn episode comes scored by
its environment, and the episodes that ended early are warned about once per step); GRPO advantages per group.
Over several ranks the functions run once per sample: rank 0 scores the gathered completions and the other
ranks get its scores (``ScoredOnce``), so every rank computes the same advantages; an episode is scored once,
by the rank that played it.

A reward function that fails on a sample (raises, hangs, returns the wrong length or not a number) scores it 0
and is counted (`reward_errors` in the metrics), with one warning per step naming the first error.

A sample that no function judged (each returned None) is dropped from the step: its advantage is 0 and its
group's mean and std are those of the other members (``grpo.group_advantages(keep=)``), and its completion's
tokens leave the update's losses (its mask is cleared, as a tool's observation tokens are: out of the policy
loss and its token count, and out of the draft's loss). `reward_dropped` counts them; `reward_mean` is over
the others. Dropping it from the draft's loss too keeps one mask for both losses (the draft could learn from
those tokens, but the one packed layout has no separate policy mask).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from codraft.config import RunConfig
from codraft.rewards import ScoredOnce
from codraft.rl.grpo import group_advantages
from codraft.rl.rollout_phase import Rollout


@dataclass
class Scored:
    """Step 2: rewards and GRPO advantages."""
    rewards: torch.Tensor       # (N,) (0 where dropped)
    advantages: torch.Tensor    # (N,)
    errors: list                # one line per failed (reward function, sample); those scored 0
    kept: torch.Tensor = None   # (N,) bool: False where no reward function judged the sample (dropped)
    metrics: dict = field(default_factory=dict)  # reward/NAME_mean per function, reward_dropped


def score(step: int, rollout: Rollout, cfg: RunConfig, *, env, rewards, tok, world) -> Scored:
    """2. Rewards (a failing reward function scores 0, with one warning per step; None drops a sample) and
    advantages. A multi-turn ``env``'s episodes come scored; otherwise the run's ``rewards`` score the completions
    (decoded by ``tok``), once over the ranks of ``world``."""
    r, g = cfg.rollout, cfg.grpo
    metrics = {}
    if env is not None:  # episodes come scored by their environment (one reward per episode)
        totals = [o.reward for o in rollout.out]
        errors = [repr(o.reward_error) for o in rollout.out if o.reward_error is not None]
        ended = [o.reason for o in rollout.out if o.reason is not None]
        if ended:
            warnings.warn(f"step {step}: {len(ended)}/{len(rollout.out)} episodes ended early (first: {ended[0]})",
                          stacklevel=4)
    else:  # (over several ranks rank 0 scores the gathered batch and the others get its scores: ScoredOnce)
        s = ScoredOnce(rewards, world).score(rollout.group, [tok.decode(o.tokens) for o in rollout.out],
                                             [o.tokens for o in rollout.out])
        totals, errors = s.totals, s.errors
        metrics = function_means(s.per_function)
    metrics["reward_dropped"] = sum(t is None for t in totals)
    kept = torch.tensor([t is not None for t in totals])
    values = torch.tensor([0.0 if t is None else t for t in totals])
    for i in (~kept).nonzero().flatten().tolist():  # dropped: its tokens leave the losses (see the module doc)
        o = rollout.out[i]
        rollout.out[i] = dataclasses.replace(o, mask=[False] * len(o.tokens))
    if errors:
        warnings.warn(f"step {step}: reward function failed on {len(errors)}/{len(rollout.group)} samples, "
                      f"scored 0 (first error: {errors[0]})", stacklevel=4)  # at Trainer.step()'s caller
    advantages = group_advantages(values, r.group_size, leave_one_out=g.leave_one_out, keep=kept)
    return Scored(values, advantages, errors, kept, metrics)


def function_means(per_function: dict) -> dict:
    """reward/NAME_mean: each function's mean over the samples it judged (its failures count as 0)."""
    out = {}
    for name, values in per_function.items():
        judged = [v for v in values if v is not None]
        if judged:
            out[f"reward/{name}_mean"] = sum(judged) / len(judged)
    return out
