"""Multi-turn tool calling end to end: a short warm start on `lookup` episodes, then the trainer in the
`lookup` environment with a co-trained draft: the policy calls its tools, the run resumes, a broken
tool ends only its episodes, and `codraft bench multiturn` reports its rows."""
from __future__ import annotations

import json
import os

import pytest

from codraft.bench.multiturn import run as bench_multiturn
from codraft.config import load_config
from codraft.envs import Lookup
from codraft.rl.trainer import Trainer, train


def _cfg(policy, run_dir, steps=3, extra=()):
    return load_config("tiny-tools", [f"policy.init={policy}", f"run_dir={run_dir}", f"steps={steps}",
                                      "draft.init=random", "rollout.prompts_per_step=4", "log.val_every=0",
                                      "log.speedup_every=1", "log.checkpoint_every=3", *extra])


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tool_calling_run_resumes(tiny_tools_policy, tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(tiny_tools_policy, run_dir), progress=False)
    rows = _rows(run_dir)
    assert len(rows) == 3
    for r in rows:
        assert r["tool_calls_mean"] >= 1 and r["turns_mean"] == pytest.approx(r["tool_calls_mean"] + 1, abs=1.0)
        assert r["env_errors"] == 0 and r["time_env"] >= 0 and len(r["acceptance_length_per_turn"]) == 4
        assert r["rollout_speedup"] > 0 and 0 < r["time_rollout"] < r["time_step"]
    train(_cfg(tiny_tools_policy, run_dir, steps=5), resume=str(run_dir), progress=False)
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4, 5]


def test_a_tool_that_hangs_ends_only_its_episodes(tiny_tools_policy, tmp_path):
    """Every call sleeps past env.timeout: the episodes end with reward 0, counted and warned about, and
    the run goes on."""
    cfg = _cfg(tiny_tools_policy, tmp_path / "run", steps=1, extra=("env.latency_ms=400", "env.timeout=0.05"))
    tr = Trainer(cfg, progress=False)
    try:
        with pytest.warns(UserWarning, match="episodes ended early .*env.timeout=0.05"):
            m = tr.step(0)
    finally:
        tr._unlock()
    assert m["env_errors"] >= 1 and m["episodes_ended_early"] >= m["env_errors"]
    assert float(m["reward_mean"]) <= 1 - m["env_errors"] / 16


class ExitingLookup(Lookup):
    """`dept` ends its process (os._exit) for the employees before "m": your code, so a worker process's."""

    def __post_init__(self):
        super().__post_init__()
        dept = self.tools["dept"]
        self.tools["dept"] = lambda who: os._exit(3) if who < "m" else dept(who)


def test_a_tool_that_exits_its_process_ends_only_its_episodes(tiny_tools_policy, tmp_path):
    """A tool that calls os._exit(3) used to end the run silently: now each such call is an env error of
    its episode, warned about, and the run takes its next step."""
    cfg = _cfg(tiny_tools_policy, tmp_path / "run", steps=2)
    tr = Trainer(cfg, progress=False)
    try:
        tr.env = ExitingLookup(tr.env.task)
        for step in range(2):
            with pytest.warns(UserWarning, match="episodes ended early"):
                m = tr.step(step)
            died = [o for o in tr.last_rollout if o.fault and "died (exit code 3) during tool 'dept'" in o.reason]
            assert m["env_errors"] >= len(died) >= 1 and m["episodes_ended_early"] >= m["env_errors"]
            assert m["observations_cut"] == 0
    finally:
        tr._unlock()


def test_bench_multiturn_rows(tiny_tools_policy, tmp_path):
    out = bench_multiturn(latencies=(0.0, 30.0), steps=1, json_path=tmp_path / "mt.json", log=lambda *_: None,
                          overrides=(f"policy.init={tiny_tools_policy}", "draft.init=random", "rollout.prompts_per_step=2"))
    rows = json.loads((tmp_path / "mt.json").read_text())["rows"]
    assert [r["latency_ms"] for r in rows] == [0.0, 30.0] == [r["latency_ms"] for r in out["rows"]]
    for r in rows:
        assert r["e2e_speedup"] == pytest.approx((r["time_step"] - r["time_rollout"] + r["time_rollout_plain"])
                                                 / r["time_step"])
    assert rows[1]["time_env_wait"] > rows[0]["time_env_wait"]
