"""`codraft train parallel.pp=2` launched with torchrun equals the single-process run over the same
micro-batches (metrics per step and the saved weights), writes a checkpoint whose consolidated policy
loads in one process and in `transformers` and whose DCP part holds every stage's optimiser state, and resumes across PP = 2 ↔ PP = 1 in both directions
with the same next step. (A random policy earns no reward, so its GRPO gradient is zero here; the
draft's is not. tests/distributed/test_pp_step.py checks every gradient with non-zero advantages.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from codraft.models import load_pretrained
from test_cp_train import _policy_dir

KEYS = ("reward_mean", "completion_len", "policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm",
        "policy/entropy", "acceptance_length")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _launch(pp, args, timeout=300):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}"] \
        if pp > 1 else [sys.executable]
    done = subprocess.run([*launch, "-m", "codraft", "train", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/loss" in r}


def _run(tmp_path, name, pp, policy, transport="shm"):
    run_dir = tmp_path / name
    _launch(pp, [f"policy.init={policy}", "steps=2", f"run_dir={run_dir}", "rollout.prompts_per_step=2",
                 "rollout.group_size=2", "rollout.max_new_tokens=24", "rollout.shards=2", "log.val_every=0",
                 "log.speedup_every=0", "log.checkpoint_every=1", "draft.kind=eagle3", "draft.init=random",
                 "draft.gamma=3", "grpo.lr=1e-3", "parallel.microbatches=2", f"parallel.pp={pp}",
                 f"parallel.taps={transport}", "parallel.timeout=60"])
    return run_dir


def _dcp_state(folder, out):
    """A DCP checkpoint's tensors by flattened key, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    dcp_to_torch_save(folder, out)
    return flatten_state_dict(torch.load(out, weights_only=False))[0]


def _same_rows(a, b, steps):
    for step in steps:
        for key in KEYS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_torchrun_pp2_equals_single_process_and_resumes_both_ways(tmp_path):
    policy = _policy_dir(tmp_path)
    ref = _run(tmp_path, "pp1", 1, policy)
    got = _run(tmp_path, "pp2", 2, policy, transport="p2p")
    _same_rows(_rows(got), _rows(ref), (1, 2))
    # rank 0 wrote one checkpoint per step, consolidated: the same weights as the one-process run
    assert sorted(p.name for p in got.iterdir() if p.is_dir() and p.name.startswith("step_")) == ["step_1", "step_2"]
    for part in ("policy/model.safetensors", "draft.pt"):
        a, b = [load_file(d / "step_2" / part) if part.endswith("safetensors") else
                torch.load(d / "step_2" / part, weights_only=True) for d in (got, ref)]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=f"{part} {k}")
    # every stage's Adam moments, in the ranks' DCP part (sharded/): the one-process run's, by parameter name
    shards = _dcp_state(got / "step_2" / "sharded", tmp_path / "dcp.pt")
    opt_b = torch.load(ref / "step_2" / "optim.pt", weights_only=False)
    policy_names = [n for n, _ in load_pretrained(ref / "step_2" / "policy").named_parameters()]
    draft_names = [k for k in torch.load(ref / "step_2" / "draft.pt", weights_only=True)
                   if f"draft_optim.state.{k}.exp_avg" in shards]
    for name, names in (("policy", policy_names), ("draft", draft_names)):
        state = opt_b[name]["state"]
        assert len(state) == len(names) > 0, name
        for i, moments in state.items():
            for k, v in moments.items():
                torch.testing.assert_close(shards[f"{name}_optim.state.{names[i]}.{k}"], v, rtol=1e-4, atol=1e-7)
    # the consolidated policy folder loads in transformers
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(got / "step_2" / "policy")
    assert sum(p.numel() for p in hf.parameters()) > 0
    # PP=2 -> PP=1 and PP=1 -> PP=2 resume to the same step 3
    _launch(1, ["--resume", str(got), "steps=3", "parallel.pp=1"])
    _launch(2, ["--resume", str(ref), "steps=3", "parallel.pp=2"])
    for run_dir, changed in ((got, "parallel.pp"), (ref, "parallel.pp")):
        log = [json.loads(line) for line in (run_dir / "resume_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 2 and changed in log[-1]["changed"]
    _same_rows(_rows(got), _rows(ref), (3,))
