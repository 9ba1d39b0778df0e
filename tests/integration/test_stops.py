"""`codraft train` in one process stopped by SIGTERM (exit 143, the last completed step saved) and by a full
disk while it checkpoints (one line naming the folder and the bytes needed, no temporary folder left, the
previous checkpoint kept); each then resumes to the uninterrupted run's metrics. The full disk is injected
into the writer (always) and, where this machine lets a test mount one, is a real small tmpfs."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import codraft.config
import codraft.models.hf_io as hf_io
from codraft.cli import main
from codraft.rl.logger import read_metrics
from codraft.rl.trainer import train
from codraft.train.checkpoint import list_checkpoints
from tiny_runs import assert_same_steps, comparable, run_config, step_rows

ARGS = ["steps=4", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
        "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=2", "draft.kind=dflash", "draft.init=random",
        "draft.gamma=3", "seed=1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_KERNELS": "0"}
WAIT = 600  # seconds one run may take on a loaded machine


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "codraft", "train", *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _codraft(*args) -> None:
    proc = _start(*args)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err[-4000:]



def _stopped(proc: subprocess.Popen) -> bool:
    """SIGSTOP ``proc`` and wait until it is stopped (False: it has ended)."""
    proc.send_signal(signal.SIGSTOP)
    while proc.poll() is None:
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "tT":
            return True
        time.sleep(0.001)
    return False


def _held_at(proc: subprocess.Popen, ready, what: str) -> None:
    """Wait until ``ready()``, checked while the run is stopped, and leave it stopped there (SIGCONT goes on):
    however loaded the machine, the run cannot pass the point (or end) between the check and what follows."""
    deadline = time.monotonic() + WAIT
    while _stopped(proc):
        if ready():
            return
        proc.send_signal(signal.SIGCONT)
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {WAIT} s")
        time.sleep(0.05)
    raise AssertionError(f"the run ended before {what}: {proc.communicate()[1][-4000:]}")


def _no_temporaries(run: Path) -> None:
    assert not list(run.glob(".step_*")) and not list(run.glob("step_*/.*.tmp-*")), sorted(os.listdir(run))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run's metrics (the tiny preset's policy: it earns rewards, so it trains)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    _codraft(f"run_dir={run}", *ARGS)
    return step_rows(run)


def test_sigterm_in_one_process_saves_the_last_completed_step_and_exits_143(tmp_path, reference):
    run = tmp_path / "run"
    proc = _start(f"run_dir={run}", *ARGS)
    _held_at(proc, lambda: (run / "metrics.jsonl").is_file() and step_rows(run), "first step")
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 143, err[-4000:]
    step = max(p for p in range(1, 5) if (run / f"step_{p}").is_dir())
    assert f"interrupted after step {step} by SIGTERM; latest checkpoint: {run / f'step_{step}'} " \
           f"(continue with --resume {run})\n" in err
    assert step < 4 and "Traceback" not in err
    _no_temporaries(run)
    _codraft("--resume", str(run))
    got = step_rows(run)
    assert set(reference) - set(got) <= {step}  # (a signal after the commit point, before the row: row missing)
    assert_same_steps(got, reference)


def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes(tmp_path, tiny_policy_dir, monkeypatch,
                                                                         varied_reward):
    """The writer fails with ENOSPC in the second checkpoint (step 4), as a full disk makes it: `codraft train`
    stops with one line, nothing of step 4 is left, step 2 stays and resumes to the uninterrupted metrics."""
    train(run_config(tiny_policy_dir, tmp_path / "full", 4), progress=False)
    real = hf_io.save_file

    def full_disk(state, path, **kw):
        if "step_4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(state, path, **kw)
    monkeypatch.setattr(hf_io, "save_file", full_disk)
    run = tmp_path / "cut"
    cfg = run_config(tiny_policy_dir, run, 4)
    monkeypatch.setattr(codraft.config, "load_config", lambda *a: cfg)  # `codraft train` runs this config
    with pytest.raises(SystemExit) as stop:
        main(["train"])
    message = stop.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith(f"codraft train: error: no space left on device writing the checkpoint of step 4 in "
                              f"{run}: it needs about "), message
    assert " are free; its temporary files were removed and the previous checkpoint " \
           f"{run / 'step_2'} is kept (continue with --resume {run} once there is room)" in message
    _no_temporaries(run)
    assert [p.name for p in list_checkpoints(run)] == ["step_2"]

    monkeypatch.setattr(hf_io, "save_file", real)
    train(run_config(tiny_policy_dir, run, 4), resume=str(run), progress=False)
    assert comparable(read_metrics(tmp_path / "full")) == comparable(read_metrics(run))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB tmpfs of the test's own (skipped where mounting is not permitted: not root, a container)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = shutil.which("mount")
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True,
                          text=True) if mount else None
    if done is None or done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() if done else 'no mount command'}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_real_full_disk_is_one_line_and_the_run_resumes(small_disk, reference):
    """Once step 2 is saved the tmpfs is filled but for 256 kB: the write of step 4 (~15 MB) meets ENOSPC."""
    run = small_disk / "run"
    proc = _start(f"run_dir={run}", *ARGS)
    _held_at(proc, lambda: (run / "step_2").is_dir(), "checkpoint of step 2")
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(small_disk).free - 256 * 1024)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 1, err[-4000:]
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"codraft train: error: no space left on device writing the checkpoint of step 4 in "
                           f"{run}: it needs about "), err[-4000:]
    assert f"the previous checkpoint {run / 'step_2'} is kept" in last and "Traceback" not in err
    _no_temporaries(run)
    assert [p.name for p in list_checkpoints(run)] == ["step_2"]

    filler.unlink()
    _codraft("--resume", str(run))
    got = step_rows(run)
    assert sorted(got) == sorted(reference)
    assert_same_steps(got, reference)
