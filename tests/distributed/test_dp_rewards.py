"""Over several ranks the reward functions run once per sample: rank 0 scores the gathered batch and every
rank gets its scores (``ScoredOnce``), so a function whose value depends on the process (a judge that answers
differently, a timeout on one rank) cannot give the ranks different rewards and advantages. A real 2-rank
gloo group."""
from __future__ import annotations

import os
from types import SimpleNamespace

from codraft.parallel.comm import Group
from codraft.rewards.calling import Result
from codraft.rewards.reward_set import RewardFn, RewardSet
from codraft.rl import scoring
from codraft.rl.rollout_phase import Rollout
from codraft.tasks import Problem
from tests.dist_harness import run_ranks


def _rank(rank, world, calls):
    def by_process(problems, batch):  # a reward that is the process's own: rank 1 would give other values
        with open(calls, "a") as f:
            f.write(f"{rank} {len(problems)}\n")
        return Result([float((i + rank) % 2) for i in range(len(problems))], [None] * len(problems))

    group = [Problem(f"q{i // 2}", "1", "1") for i in range(4)]
    out = [SimpleNamespace(tokens=[i, 1], mask=None) for i in range(4)]
    cfg = SimpleNamespace(rollout=SimpleNamespace(group_size=2), grpo=SimpleNamespace(leave_one_out=False))
    s = scoring.score(0, Rollout(group, [[0]] * 4, out, None, 0.0, 0), cfg, env=None,
                      rewards=RewardSet([RewardFn("by_process", 1.0, by_process)]), world=Group.world(60.0),
                      tok=SimpleNamespace(decode=lambda ids: " ".join(map(str, ids))))
    return s.rewards.tolist(), s.advantages.tolist(), os.getpid()


def test_every_rank_gets_rank_0s_rewards_and_the_functions_run_once(tmp_path):
    calls = tmp_path / "calls"
    (r0, a0, p0), (r1, a1, p1) = run_ranks(_rank, 2, str(calls))
    assert p0 != p1
    assert r0 == r1 == [0.0, 1.0, 0.0, 1.0]  # rank 0's values (rank 1's own would be [1, 0, 1, 0])
    assert a0 == a1 and any(a0)
    assert calls.read_text().splitlines() == ["0 4"]  # once per sample, on rank 0
