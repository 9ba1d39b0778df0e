"""`codraft train parallel.dp=2` (and parallel.tp=2) under torchrun: the same metrics per step as one process
over the same prompts (both decode rollout.shards=4 shards), rank 0 alone writes the run folder, and its
checkpoint resumes at another layout (dp=1, and cp=2 under torchrun) with the next step equal to the
one-process run's resumed the same way; a dp=2 × pp=2 checkpoint (FSDP-sharded stages) resumes in one process
and a one-process checkpoint at dp=2 × pp=2 and at tp=2, a tp=2 checkpoint in one process. (pp=2 ↔ pp=1:
test_pp_train.) The policy is the tiny preset's (tiny-sft: it earns
rewards, so the GRPO gradient is not zero)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

KEYS = ("reward_mean", "completion_len", "policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm",
        "policy/entropy", "acceptance_length")
ARGS = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24", "rollout.shards=4",
        "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=1", "draft.kind=dflash", "draft.init=random",
        "draft.gamma=3", "seed=1", "parallel.timeout=60"]


def _codraft(nproc, *args):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    done = subprocess.run([*launch, "-m", "codraft", "train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/loss" in r}


def _same(got, want):
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["step"], key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run of 3 steps (2, then resumed for 1: the lr cosine follows `steps`, so the same
    history as the others'), and a copy of its folder at step 2."""
    ref = tmp_path_factory.mktemp("one") / "run"
    _codraft(1, "steps=2", f"run_dir={ref}", *ARGS)
    at_two = ref.parent / "at-step-2"
    shutil.copytree(ref, at_two)
    _codraft(1, "--resume", str(ref), "steps=3")
    return ref, at_two


def test_torchrun_dp2_equals_single_process_and_resumes_at_other_layouts(tmp_path, one_process):
    ref = tmp_path / "one"
    shutil.copytree(one_process[0], ref)
    want = _rows(ref)
    assert want[1]["policy/grad_norm"] > 1e-3  # the policy really trains

    run = tmp_path / "dp2"
    stdout = _codraft(2, "steps=2", f"run_dir={run}", "parallel.dp=2", *ARGS)
    got = _rows(run)
    assert sorted(got) == [1, 2] and stdout.count("metrics.jsonl") <= 1  # rank 0 wrote one row per step
    for step in (1, 2):
        _same(got[step], want[step])
    assert got[1]["time_refit"] > 0 and got[1]["refit_peak_bytes"] >= 0
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and p.name.startswith("step_")) == ["step_1", "step_2"]
    # every rank's shards of the policy and its AdamW state (DCP), the whole policy as an HF folder
    step = run / "step_2"
    assert (step / "sharded" / ".metadata").is_file() and len(list((step / "sharded").glob("*.distcp"))) == 2
    assert "policy" not in torch.load(step / "optim.pt", weights_only=True) and (step / "policy" / "config.json").is_file()
    assert not list(run.glob(".step_*"))  # no shards left outside a checkpoint

    other = tmp_path / "dp2-then-cp2"
    shutil.copytree(run, other)
    _codraft(1, "--resume", str(run), "steps=3", "parallel.dp=1")
    _codraft(2, "--resume", str(other), "steps=3", "parallel.dp=1", "parallel.cp=2")
    for folder, changed in ((run, {"parallel.dp"}), (other, {"parallel.dp", "parallel.cp"})):
        _same(_rows(folder)[3], want[3])
        log = [json.loads(line) for line in (folder / "resume_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 2 and changed <= set(log[-1]["changed"])


def test_torchrun_fsdp_under_pipeline_stages_equals_single_process_and_resumes(tmp_path, one_process):
    """dp=2 × pp=2 with each stage sharded over its two data ranks (4 ranks): the one-process metrics; its
    checkpoint (every rank's part) resumes in one process, and a one-process checkpoint resumes at it."""
    ref, at_two = one_process
    want = _rows(ref)
    run = tmp_path / "dp2pp2"
    _codraft(4, "steps=2", f"run_dir={run}", "parallel.dp=2", "parallel.pp=2", "parallel.dp_shard=fsdp", *ARGS)
    got = _rows(run)
    for step in (1, 2):
        _same(got[step], want[step])
    assert got[1]["time_refit"] > 0
    step = run / "step_2"
    assert len(list((step / "sharded").glob("*.distcp"))) == 4 and (step / "policy" / "config.json").is_file()
    _codraft(1, "--resume", str(run), "steps=3", "parallel.dp=1", "parallel.pp=1")
    spread = tmp_path / "one-then-dp2pp2"
    shutil.copytree(at_two, spread)
    _codraft(4, "--resume", str(spread), "steps=3", "parallel.dp=2", "parallel.pp=2", "parallel.dp_shard=fsdp")
    for folder in (run, spread):
        _same(_rows(folder)[3], want[3])


def test_torchrun_tp2_equals_single_process_and_resumes_across_tp_degrees(tmp_path, one_process):
    """parallel.tp=2: the one-process metrics; its checkpoint (every rank's tensor-parallel shards, DCP) resumes
    in one process, and a one-process checkpoint resumes at tp=2 (its whole optimiser state split on load)."""
    ref, at_two = one_process
    want = _rows(ref)
    run = tmp_path / "tp2"
    _codraft(2, "steps=2", f"run_dir={run}", "parallel.tp=2", *ARGS)
    got = _rows(run)
    for step in (1, 2):
        _same(got[step], want[step])
    assert got[1]["time_refit"] > 0  # the engine's whole copy gathered from the shards
    step = run / "step_2"
    assert len(list((step / "sharded").glob("*.distcp"))) == 2 and (step / "policy" / "config.json").is_file()
    _codraft(1, "--resume", str(run), "steps=3", "parallel.tp=1")
    spread = tmp_path / "one-then-tp2"
    shutil.copytree(at_two, spread)
    _codraft(2, "--resume", str(spread), "steps=3", "parallel.tp=2")
    for folder in (run, spread):
        _same(_rows(folder)[3], want[3])
        log = [json.loads(line) for line in (folder / "resume_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 2 and "parallel.tp" in log[-1]["changed"]


def test_torchrun_two_nodes_with_a_c10d_rendezvous(tmp_path, one_process):
    """The multi-machine launch as documented (two torchrun agents, --nnodes 2, a c10d rendezvous), both on
    this host: the same step as one process."""
    import socket
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "two-nodes"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=codraft-test",
                                "-m", "codraft", "train", "steps=1", f"run_dir={run}", "parallel.dp=2", *ARGS],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-4000:]
    _same(_rows(run)[1], _rows(one_process[0])[1])
