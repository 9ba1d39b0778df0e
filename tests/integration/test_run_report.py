"""What a run reports: the summary's first/last windows (never one window twice) and no speedup figure
for a run without a draft (its rollout is the plain one)."""
import json

import pytest

from codraft.rl.logger import read_metrics
from codraft.rl.runs import report
from codraft.rl.trainer import Trainer
from tiny_runs import run_config


def _run_with_rewards(path, rewards):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "reward_mean": r}) + "\n"
                                                for i, r in enumerate(rewards)))
    return path


def _reward_line(run) -> str:
    return next(line for line in report(run).splitlines() if line.startswith("reward: "))


def test_the_summary_windows_never_overlap(tmp_path):
    assert _reward_line(_run_with_rewards(tmp_path / "one", [0.5])) == "reward: 0.500 (step 1)"
    assert _reward_line(_run_with_rewards(tmp_path / "two", [0.5, 0.7])) == "reward: 0.500 (step 1) -> 0.700 (step 2)"
    assert _reward_line(_run_with_rewards(tmp_path / "five", [0, 1, 2, 3, 4])) == \
        "reward: 0.500 (steps 1-2) -> 3.500 (steps 4-5)"
    assert _reward_line(_run_with_rewards(tmp_path / "long", list(range(30)))) == \
        "reward: 4.500 (steps 1-10) -> 24.500 (steps 21-30)"


def test_no_rollout_speedup_without_a_draft(tmp_path, tiny_policy_dir):
    cfg = run_config(tiny_policy_dir, tmp_path / "run", 2, mode="none", extra=["log.speedup_every=1"])
    Trainer(cfg, progress=False).fit()
    rows = [r for r in read_metrics(tmp_path / "run") if "reward_mean" in r]
    assert len(rows) == 2 and not any("rollout_speedup" in r or "time_rollout_plain" in r for r in rows)


def test_samples_are_the_steps_completions_with_their_rewards(tmp_path, tiny_policy_dir):
    """Two prompts a step (run_config): samples.jsonl holds every completion, so their rewards average to the
    step's reward_mean and their advantages to 0 per group."""
    cfg = run_config(tiny_policy_dir, tmp_path / "run", 2, extra=["log.samples_every=1", "task.format_reward=0.5"])
    Trainer(cfg, progress=False).fit()
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run") if "reward_mean" in r}
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4
    for step, row in rows.items():
        mine = [s for s in samples if s["step"] == step]
        assert sum(s["reward"] for s in mine) / 4 == pytest.approx(row["reward_mean"])
        assert all(isinstance(s["prompt"], str) and isinstance(s["completion"], str) for s in mine)
        assert sum(s["advantage"] for s in mine[:2]) == pytest.approx(0, abs=1e-6)


def test_a_run_without_learning_signal_is_warned_about(tmp_path, tiny_policy_dir):
    """The random tiny policy writes no answer: every reward is 0, so every advantage is."""
    cfg = run_config(tiny_policy_dir, tmp_path / "run", 3, extra=["log.no_signal_steps=2", "log.val_every=0"])
    with pytest.warns(UserWarning, match=r"steps 1-2: every prompt's 2 completions got one reward") as seen:
        Trainer(cfg, progress=False).fit()
    assert sum("got one reward" in str(w.message) for w in seen) == 1  # once per streak
    assert all(r["reward_mean"] == 0 for r in read_metrics(tmp_path / "run") if "reward_mean" in r)
