"""What a run reports: the summary's first/last windows (never one window twice) and no speedup figure
for a run without a draft (its rollout is the plain one)."""
import json

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
