"""A data-parallel run's checkpoint with a planted DCP ``.metadata`` (a genuine one with an object inside whose
``__reduce__`` runs a shell command; ``state.json``'s size and sha256 updated to match, as whoever can edit
the folder can): ``--resume`` at dp=2 under torchrun and at dp=1 never runs it. The checkpoint is skipped like
a corrupt one (a warning naming the file, the run continues from the one before); when none is left, the
resume stops with one line per rank naming the files. Oracle: the marker file the command would create."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from codraft.train import checkpoint as ckpt
from tiny_runs import save_tiny_policy

ARGS = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "log.val_every=0",
        "log.speedup_every=0", "log.checkpoint_every=1", "log.keep_last=3", "draft.kind=dflash", "draft.init=random",
        "draft.gamma=3", "parallel.timeout=60"]


class _Touch:
    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return os.system, (f"touch '{self.flag}'",)


def _codraft(nproc, *args):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    return subprocess.run([*launch, "-m", "codraft", "train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def _plant(step, flag):
    """The genuine metadata with the command tucked into its planner data, the checksum updated."""
    meta = step / ckpt.SHARDS / ".metadata"
    with open(meta, "rb") as f:
        md = pickle.load(f)  # (the test's own file)
    md.planner_data["policy.norm.weight"] = _Touch(flag)
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    marker = json.loads((step / ckpt.MARKER).read_text())
    rel = f"{ckpt.SHARDS}/.metadata"
    assert rel in marker["files"]  # state.json covers it: without the fix, verify passes and DCP runs it
    marker["files"][rel] = {"size": meta.stat().st_size, "sha256": ckpt._sha256(meta)}
    (step / ckpt.MARKER).write_text(json.dumps(marker))
    assert ckpt.verify(step) is None
    return meta


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """A 2-step dp=2 run (a DCP part in step_1 and step_2)."""
    root = tmp_path_factory.mktemp("planted")
    policy = save_tiny_policy(root / "policy")
    run = root / "run"
    done = _codraft(2, f"policy.init={policy}", "steps=2", f"run_dir={run}", "parallel.dp=2", *ARGS)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (run / "step_2" / ckpt.SHARDS / ".metadata").is_file()
    return run


REFUSED = "refused: it would run code when loaded (pickled GLOBAL '{}.system'); codraft loads only tensors and " \
          "plain data".format(os.system.__module__)


@pytest.mark.parametrize("dp", [2, 1])
def test_a_planted_metadata_never_runs_and_the_run_falls_back(tmp_path, dp2_run, dp):
    run, flag = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(dp2_run, run)
    meta = _plant(run / "step_2", flag)
    done = _codraft(dp, "--resume", str(run), "steps=3", f"parallel.dp={dp}")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not flag.exists()
    assert f"checkpoint {run / 'step_2'} is not usable: {meta}: {REFUSED}; falling back" in done.stderr
    log = [json.loads(line) for line in (run / "resume_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 1 and log[-1]["skipped"][0].startswith(f"step_2: {meta}: refused")
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_1", "step_2", "step_3"]  # steps 2, 3 ran again


@pytest.mark.parametrize("dp", [2, 1])
def test_when_every_checkpoint_is_planted_the_resume_stops_in_one_line(tmp_path, dp2_run, dp):
    run, flag = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(dp2_run, run)
    metas = {n: _plant(run / f"step_{n}", flag) for n in (2, 1)}
    done = _codraft(dp, "--resume", str(run), "steps=3", f"parallel.dp={dp}")
    assert done.returncode != 0 and not flag.exists()
    errors = [line for line in done.stderr.splitlines() if line.startswith("codraft train")]
    prefixes = [f"codraft train (rank {r} of 2): error: " for r in range(2)] if dp == 2 else ["codraft train: error: "]
    want = [f"{prefix}no checkpoint in {run} verifies: step_2: {metas[2]}: {REFUSED}; step_1: {metas[1]}: {REFUSED}"
            for prefix in prefixes]
    # under torchrun the agent may stop one rank before it prints: at least one, and each as it should be
    assert errors and set(errors) <= set(want), done.stderr[-4000:]
    # the only traceback is torchrun's own, which it prints when a rank exits non-zero
    assert done.stderr.count("Traceback") == (dp == 2) and "Unpickling" not in done.stderr, done.stderr[-4000:]
