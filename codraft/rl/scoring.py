"""Step 2 of an RL step (``Trainer.score``): the task scores each completion (a multi-turn episode comes
scored by its environment, and the episodes that ended early are warned about once per step); GRPO
advantages per group.

A reward function that raises scores that sample 0 and is counted (`reward_errors` in the metrics),
with one warning per step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from codraft.rl.grpo import group_advantages
from codraft.rl.rollout_phase import Rollout

if TYPE_CHECKING:
    from codraft.rl.trainer import Trainer


@dataclass
class Scored:
    """Step 2: rewards and GRPO advantages."""
    rewards: torch.Tensor       # (N,)
    advantages: torch.Tensor    # (N,)
    errors: list                # the exceptions of reward functions that failed (those samples scored 0)


def score(tr: Trainer, step: int, rollout: Rollout) -> Scored:
    """2. Rewards (a failing reward function scores 0, with one warning per step) and advantages."""
    r, g = tr.cfg.rollout, tr.cfg.grpo
    if tr.env is not None:  # episodes come scored by their environment (one reward per episode)
        scored = [(o.reward, o.reward_error) for o in rollout.out]
        ended = [o.reason for o in rollout.out if o.reason is not None]
        if ended:
            warnings.warn(f"step {step}: {len(ended)}/{len(rollout.out)} episodes ended early (first: {ended[0]})",
                          stacklevel=4)
    else:
        scored = [tr.task.score(p, tr.tok.decode(o.tokens)) for p, o in zip(rollout.group, rollout.out)]
    rewards = torch.tensor([x for x, _ in scored])
    errors = [e for _, e in scored if e is not None]
    if errors:
        warnings.warn(f"step {step}: reward function failed on {len(errors)}/{len(rollout.group)} samples, "
                      f"scored 0 (first error: {errors[0]!r})", stacklevel=4)  # at Trainer.step()'s caller
    return Scored(rewards, group_advantages(rewards, r.group_size, leave_one_out=g.leave_one_out), errors)
