"""Reward functions by name (``reward.funcs``): TRL's and verl's conventions, built-ins (``math``, ``exact``,
``regex``, every task's own), weights, and your code isolated in a worker process (docs/your-data.md).

``reward_set``: the run's functions and how they combine; ``calling``: loading one and calling it its way;
``builtin``: the rewards built in; ``worker``: the process your functions run in.
"""
from codraft.rewards.builtin import BUILTINS
from codraft.rewards.calling import Batch, Result
from codraft.rewards.reward_set import (RewardError, RewardSet, ScoredOnce, Scores, build_rewards, parse_funcs,
                                        parse_weights)

__all__ = ["BUILTINS", "Batch", "Result", "RewardError", "RewardSet", "ScoredOnce", "Scores", "build_rewards",
           "parse_funcs", "parse_weights"]
