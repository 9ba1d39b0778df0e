"""`codraft train` under bad input and faults: failing rewards, NaN losses, Ctrl-C; greedy rollouts."""
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from codraft.models import load_pretrained
from codraft.rl import objective
from codraft.train.checkpoint import list_checkpoints, load_policy_from
from codraft.rl.logger import read_metrics
from codraft.tasks import ArithTask, Problem
from codraft.rl.trainer import Trainer, train
from tiny_runs import checkpoint_weights, comparable, run_config, same_tensors


def _state(t):
    """Everything an update changes: policy and draft weights, and the optimiser moments."""
    s = {f"policy.{k}": v.clone() for k, v in t.policy.state_dict().items()}
    s.update({f"draft.{k}": v.clone() for k, v in t.draft.state_dict().items()})
    for name, opt in (("opt", t.opt), ("draft_opt", t.draft_opt)):
        for i, st in opt.state.items():
            s.update({f"{name}.{i}.{k}": v.clone() for k, v in st.items()})
    return s


def _trained(ckpt_dir, policy_dir):
    """Did the policy in ckpt_dir move away from its initial weights?"""
    init = load_pretrained(policy_dir).state_dict()
    return any(not torch.equal(v, init[k]) for k, v in load_policy_from(ckpt_dir).state_dict().items())


def _nan_on(steps):
    """cotrain_loss that returns a NaN loss (still differentiable) on the given step indices."""
    real, calls = objective.cotrain_loss, []

    def loss(*a, **k):
        calls.append(1)
        out, m = real(*a, **k)
        return (out * math.nan if len(calls) - 1 in steps else out), m
    return loss


# ---------------------------------------------------------------- rewards


def test_score_reports_what_reward_hides():
    p = Problem(prompt="1+1=", answer="2", solution="1+1=2#2")
    task = ArithTask()
    assert task.score(p, "1+1=2#2") == (1.0, None)

    task._reward = lambda problem, completion: 1 / 0  # a user-patched reward function
    r, err = task.score(p, "1+1=2#2")
    assert r == 0.0 and isinstance(err, ZeroDivisionError)
    assert task.reward(p, "1+1=2#2") == 0.0  # direct callers still never see it raise

    task._reward = lambda problem, completion: math.nan  # would poison the group's advantages
    assert task.score(p, "x")[0] == 0.0 and isinstance(task.score(p, "x")[1], ValueError)


def test_reward_errors_score_zero_and_training_continues(tmp_path, tiny_policy_dir, monkeypatch):
    def flaky(self, problem, completion):  # raises on even-length completions, else full reward
        if len(completion) % 2 == 0:
            raise ValueError("reward bug")
        return 1.0
    monkeypatch.setattr(ArithTask, "_reward", flaky)
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "run", 2), progress=False)
    with pytest.warns(UserWarning, match=r"step \d: reward function failed on \d+/4 samples.*reward bug"):
        t.fit()
    expected = [0.0 if len(t.tok.decode(o.tokens)) % 2 == 0 else 1.0 for o in t.last_rollout]
    rows = [r for r in read_metrics(tmp_path / "run") if "reward_errors" in r]
    assert [r["step"] for r in rows] == [1, 2]  # both steps trained
    assert rows[-1]["reward_errors"] == expected.count(0.0)
    assert rows[-1]["reward_mean"] == pytest.approx(sum(expected) / len(expected))
    assert sum(r["reward_errors"] for r in rows) > 0
    assert all(r["skipped_update"] == 0 for r in rows)


# ---------------------------------------------------------------- NaN / inf


def test_nonfinite_loss_skips_the_update(tmp_path, tiny_policy_dir, monkeypatch, varied_reward):
    monkeypatch.setattr(objective, "cotrain_loss", _nan_on({1}))
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "run", 3), progress=False)
    t.step(0)
    before, lr_before = _state(t), t.sched.get_last_lr()
    with pytest.warns(UserWarning, match=r"step 1: non-finite loss.*update skipped \(1 in a row\)"):
        m = t.step(1)
    assert m["skipped_update"] == 1 and m["nonfinite_streak"] == 1
    assert same_tensors(before, _state(t))  # θ, φ and Adam moments untouched
    assert all(p.grad is None for p in t.policy.parameters())
    assert all(p.grad is None for p in t.draft.parameters())
    assert t.sched.get_last_lr() != lr_before  # the LR schedule still follows the step index
    m = t.step(2)  # the next finite step trains again
    assert m["skipped_update"] == 0 and m["nonfinite_streak"] == 0
    after = _state(t)
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("policy."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("draft."))
    t.logger.close()


def test_nonfinite_streak_stops_run_and_keeps_last_good_checkpoint(tmp_path, tiny_policy_dir, monkeypatch,
                                                                   varied_reward):
    run = tmp_path / "run"
    snapshot = {}
    nan_loss = _nan_on({2, 3, 4})

    def loss(*a, **k):  # when the NaNs start, remember the bytes of the checkpoint on disk
        if not snapshot and (run / "step_2").is_dir():
            snapshot.update({p.relative_to(run): p.read_bytes() for p in (run / "step_2").rglob("*") if p.is_file()})
        return nan_loss(*a, **k)
    monkeypatch.setattr(objective, "cotrain_loss", loss)
    cfg = run_config(tiny_policy_dir, run, 8)
    cfg.log.keep_last = 1  # a checkpoint written mid-streak would rotate step_2 out
    with pytest.warns(UserWarning, match="non-finite"), \
            pytest.raises(RuntimeError, match=r"step 4: 3 non-finite .* in a row .*max_nonfinite_steps=3.*step_2"):
        train(cfg, progress=False)
    assert [p.name for p in list_checkpoints(run)] == ["step_2"]
    assert not list(run.glob(".step_*"))  # no half-written one either
    now = {p.relative_to(run): p.read_bytes() for p in (run / "step_2").rglob("*") if p.is_file()}
    assert snapshot and now == snapshot
    rows = read_metrics(run)
    assert [(r["step"], r.get("nonfinite_streak")) for r in rows[-3:]] == [(3, 1), (4, 2), (5, 3)]


def test_nonfinite_stop_via_the_cli_is_one_line_and_keeps_the_run(tmp_path, tiny_policy_dir):
    """A draft lr so large that its first update overflows the draft: every later loss is NaN. The stop is
    one error line naming the last good checkpoint (no traceback), and the run keeps its metrics (the NaN
    steps included), its plots and that checkpoint."""
    run, limit = tmp_path / "run", 2
    done = subprocess.run(
        [sys.executable, "-m", "codraft", "train", f"policy.init={tiny_policy_dir}", "steps=6", f"run_dir={run}",
         "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=8", "log.val_every=0",
         "draft.kind=eagle3", "draft.init=random", "draft.gamma=2", "log.checkpoint_every=1", "log.keep_last=1",
         "draft.lr=1e38", "draft.warmup_steps=0", f"grpo.max_nonfinite_steps={limit}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = read_metrics(run)
    streak = [r for r in rows if r.get("nonfinite_streak")]
    assert [r["nonfinite_streak"] for r in streak] == list(range(1, limit + 1)) and streak[-1] == rows[-1]
    last_good = run / f"step_{streak[0]['step'] - 1}"  # the step before the streak, the checkpoint kept
    assert [p.name for p in list_checkpoints(run)] == [last_good.name]
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1] == (
        f"codraft train: error: step {rows[-1]['step'] - 1}: {limit} non-finite (NaN/inf) steps in a row "
        f"(grpo.max_nonfinite_steps={limit}); stopping. Last good checkpoint: {last_good}")
    assert (run / "reward.png").is_file() and (run / "config.yaml").is_file()


def test_max_nonfinite_steps_is_a_config_key(tmp_path, tiny_policy_dir):
    from codraft.config import ConfigError, load_config
    assert load_config(None, []).grpo.max_nonfinite_steps == 3
    assert load_config(None, ["grpo.max_nonfinite_steps=5"]).grpo.max_nonfinite_steps == 5
    cfg = run_config(tiny_policy_dir, tmp_path / "run", 1)
    cfg.grpo.max_nonfinite_steps = 0
    with pytest.raises(ConfigError, match="'grpo.max_nonfinite_steps' must be >= 1, got 0"):
        Trainer(cfg, progress=False)


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_mid_step_saves_last_completed_step_and_resumes(tmp_path, tiny_policy_dir, monkeypatch, capsys,
                                                               varied_reward):
    train(run_config(tiny_policy_dir, tmp_path / "full", 4), progress=False)
    real = Trainer._generate

    def interrupt_step_3(self, engine, prompts, seed, **kw):
        if self.prompts_used == 8:  # inside step 3: its prompts are drawn, nothing updated yet
            raise KeyboardInterrupt
        return real(self, engine, prompts, seed, **kw)
    monkeypatch.setattr(Trainer, "_generate", interrupt_step_3)
    with pytest.raises(KeyboardInterrupt):
        train(run_config(tiny_policy_dir, tmp_path / "cut", 4), progress=False)
    monkeypatch.setattr(Trainer, "_generate", real)
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step_2", "step_3"]
    assert "latest checkpoint: " + str(tmp_path / "cut" / "step_3") in capsys.readouterr().err
    assert '"prompts_used": 6' in (tmp_path / "cut" / "step_3" / "state.json").read_text()  # data position rewound

    train(run_config(tiny_policy_dir, tmp_path / "cut", 4), resume=str(tmp_path / "cut"), progress=False)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3, 4]
    assert comparable(full) == comparable(cut)
    assert same_tensors(checkpoint_weights(tmp_path / "full" / "step_4"), checkpoint_weights(tmp_path / "cut" / "step_4"))
    assert _trained(tmp_path / "cut" / "step_3", tiny_policy_dir)


@pytest.fixture
def default_sigint():
    """SIGINT raises KeyboardInterrupt, as in `codraft train` run from a terminal
    (pytest-xdist workers ignore SIGINT)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_during_the_update_completes_it_first(tmp_path, tiny_policy_dir, varied_reward, default_sigint):
    """A real SIGINT right after the policy optimiser's step: the draft optimiser and both
    schedulers still step, and the checkpoint is the completed step, equal to an uninterrupted run's."""
    train(run_config(tiny_policy_dir, tmp_path / "full", 4), progress=False)
    t = Trainer(run_config(tiny_policy_dir, tmp_path / "cut", 4), progress=False)
    calls = []

    def sigint_after_step_1(opt, args, kwargs):  # runs inside opt.step(), after the update
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
    t.opt.register_step_post_hook(sigint_after_step_1)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "cut")] == ["step_2"]
    assert same_tensors(checkpoint_weights(tmp_path / "full" / "step_2"), checkpoint_weights(tmp_path / "cut" / "step_2"))
    assert _trained(tmp_path / "cut" / "step_2", tiny_policy_dir)

    train(run_config(tiny_policy_dir, tmp_path / "cut", 4), resume=str(tmp_path / "cut"), progress=False)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 3, 4]  # step 2's row was never written (interrupted before logging)
    assert comparable([r for r in full if r["step"] != 2]) == comparable(cut)
    assert same_tensors(checkpoint_weights(tmp_path / "full" / "step_4"), checkpoint_weights(tmp_path / "cut" / "step_4"))


# ---------------------------------------------------------------- greedy rollouts


def test_greedy_first_step_rollouts_same_with_and_without_draft(tmp_path, tiny_policy_dir):
    """Lossless speculative decoding: at temperature 0 the first step's rollouts are the
    plain policy's, token for token, whatever the draft proposes."""
    tokens = {}
    for mode, kind in (("none", "dflash"), ("cotrain", "dflash"), ("cotrain", "ngram")):
        cfg = run_config(tiny_policy_dir, tmp_path / f"{mode}-{kind}", 1, kind=kind, mode=mode)
        cfg.rollout.temperature, cfg.rollout.max_new_tokens = 0.0, 24
        cfg.log.speedup_every = cfg.log.val_every = 0
        t = Trainer(cfg, progress=False)
        m = t.step(0)
        assert (mode == "none") == ("acceptance_length" not in m)  # the others really decoded speculatively
        tokens[mode, kind] = [o.tokens for o in t.last_rollout]
        t.logger.close()
    plain = tokens["none", "dflash"]
    assert len(plain) == 4 and any(len(x) > 1 for x in plain)
    assert tokens["cotrain", "dflash"] == plain
    assert tokens["cotrain", "ngram"] == plain
