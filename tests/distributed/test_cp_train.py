"""`codraft train parallel.cp=2` launched with torchrun equals the single-process run: the same
sampled rollouts (both decode rollout.shards=2 shards, so the split cannot change them), losses,
draft losses and gradient norms per step; rank 0 alone writes the run folder. (A random policy
earns no reward, so the GRPO gradient is zero here; tests/distributed/test_cp_step.py checks it with
non-zero advantages.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from codraft.models import Transformer, save_pretrained
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config
from codraft.tokenizer import CharTokenizer

KEYS = ("reward_mean", "completion_len", "policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm",
        "policy/entropy", "acceptance_length")


def _policy_dir(tmp_path):
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim = 64, 128, 2, 16
    torch.manual_seed(0)
    save_pretrained(Transformer(cfg), tmp_path / "policy",
                    extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return tmp_path / "policy"


def _run(tmp_path, name, cp, kind):
    run_dir = tmp_path / name
    args = [f"policy.init={_policy_dir(tmp_path)}", "steps=2", f"run_dir={run_dir}", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=24", "rollout.shards=2", "log.val_every=0",
            "log.speedup_every=0", "log.checkpoint_every=1", f"draft.kind={kind}", "draft.init=random",
            "draft.gamma=3", "grpo.lr=1e-3", f"parallel.cp={cp}", "parallel.timeout=60"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}"] \
        if cp > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, "-m", "codraft", "train", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in rows if "policy/loss" in r], done.stdout


@pytest.mark.parametrize("kind", ["eagle3"])
def test_torchrun_cp2_equals_single_process(tmp_path, kind):
    _, ref, _ = _run(tmp_path, "cp1", 1, kind)
    run_dir, got, stdout = _run(tmp_path, "cp2", 2, kind)
    assert len(got) == len(ref) == 2
    for r, g in zip(ref, got):
        for key in KEYS:
            assert g[key] == pytest.approx(r[key], rel=1e-4, abs=1e-6), (r["step"], key)
    # rank 0 wrote the folder once: one metrics row per step, both checkpoints, one report
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("step_")) == ["step_1", "step_2"]
    assert stdout.count("metrics.jsonl") <= 1
    # a CP run's checkpoint resumes in one process (rank 0 saved the whole state)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "codraft", "train", "--resume", str(run_dir), "steps=3",
                           "parallel.cp=1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    log = [json.loads(line) for line in (run_dir / "resume_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 2 and "parallel.cp" in log[-1]["changed"]
    assert (run_dir / "step_3").is_dir()
