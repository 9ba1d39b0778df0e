"""Ctrl-C and SIGTERM under a real torchrun: every rank stops after the same completed step, saves it (DCP,
every rank's part), prints one line and exits 128 + the signal; `--resume` then gives the uninterrupted run's
metrics. Spawned ranks: a signal during a periodic save lets it finish; a full disk, in the ranks' DCP write or
in rank 0's own, is one line on every rank, leaves no temporary folder and keeps the previous checkpoint."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import run_ranks
from tiny_runs import assert_same_steps, run_config, step_rows

ARGS = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=24", "rollout.shards=4",
        "log.val_every=0", "log.speedup_every=0", "log.checkpoint_every=0", "draft.kind=dflash", "draft.init=random",
        "draft.gamma=3", "seed=1", "parallel.timeout=60"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_KERNELS": "0"}  # (no timing of fast paths at each start)
WAIT = 600  # seconds any one launch may take on a loaded machine


def _launch(nproc: int, *args) -> subprocess.Popen:
    """torchrun leading a process group of its own (setsid), so that a signal to its process group reaches it alone, as a terminal's."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", "-m", "codraft", "train", *args],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _codraft(nproc: int, *args) -> None:
    done = _launch(nproc, *args) if nproc > 1 else subprocess.Popen(
        [sys.executable, "-m", "codraft", "train", *args], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    _, err = done.communicate(timeout=WAIT)
    assert done.returncode == 0, err[-4000:]



def _after_first_step(proc: subprocess.Popen, run: Path) -> None:
    """Wait until the run has logged a trained step (fail, never hang, if it ends or takes too long)."""
    deadline = time.monotonic() + WAIT
    while not ((run / "metrics.jsonl").is_file() and step_rows(run)):
        if proc.poll() is not None:
            raise AssertionError(f"torchrun ended before its first step: {proc.communicate()[1][-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no step logged in {run} within {WAIT} s")
        time.sleep(0.05)


def _worker(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of global rank ``rank`` (from the environment torchrun gave it)."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher \
                    and f"RANK={rank}".encode() in (d / "environ").read_bytes().split(b"\0"):
                return int(d.name)
        except OSError:  # (a process that ended meanwhile)
            continue
    raise AssertionError(f"no worker of rank {rank} under torchrun {launcher}")


def _stopped_at(err: str, world: int, name: str, run: Path) -> int:
    """The one step every rank says it stopped after, each in one line naming the checkpoint."""
    lines = re.findall(rf"^rank (\d+) of {world}: interrupted after step (\d+) by {name}; latest checkpoint: (\S+) "
                       rf"\(continue with --resume {re.escape(str(run))}\)$", err, re.M)
    assert sorted(int(r) for r, _, _ in lines) == list(range(world)), err[-4000:]
    (step,) = {int(s) for _, s, _ in lines}
    assert {c for _, _, c in lines} == {str(run / f"step_{step}")}
    return step


def _checkpoints(run: Path) -> list[str]:
    from codraft.train.checkpoint import list_checkpoints
    assert not list(run.glob(".step_*")), list(run.glob(".step_*"))  # no temporary or shard folder left
    return [p.name for p in list_checkpoints(run)]


def test_ctrl_c_to_torchrun_at_dp2_saves_the_step_every_rank_completed(tmp_path):
    """SIGINT to torchrun's process group, as a terminal sends it, then a second one while the ranks stop: both
    ranks stop after one step, saved with log.checkpoint_every=0; the resumed run is the uninterrupted one (run in
    one process: test_dp_train holds dp=2 to it over these shards)."""
    steps = ["steps=5", "parallel.dp=2", *ARGS]
    ref = tmp_path / "ref"
    _codraft(1, f"run_dir={ref}", steps[0], *ARGS)

    run = tmp_path / "cut"
    proc = _launch(2, f"run_dir={run}", *steps)
    _after_first_step(proc, run)
    os.killpg(proc.pid, signal.SIGINT)  # torchrun sends it on to each worker's process group
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # a second Ctrl-C: the save still completes
    _, err = proc.communicate(timeout=WAIT)
    step = _stopped_at(err, 2, "SIGINT", run)
    assert 1 <= step < 5 and _checkpoints(run) == [f"step_{step}"]
    assert len(list((run / f"step_{step}" / "sharded").glob("*.distcp"))) == 2  # every rank's part
    assert sorted(step_rows(run)) == list(range(1, step + 1))

    _codraft(2, "--resume", str(run), *steps[1:2])
    assert_same_steps(step_rows(run), step_rows(ref), rel=1e-4, abs=1e-6)


def test_sigterm_to_one_rank_of_dp2_pp2_stops_all_four_after_one_step(tmp_path):
    """dp=2 × pp=2: SIGTERM reaches rank 3 alone; the four ranks agree at the next step boundary, save that step
    together and exit 143 (torchrun reports each worker's status); the resumed run is the uninterrupted one (in
    one process, as above)."""
    steps = ["steps=4", "parallel.dp=2", "parallel.pp=2", *ARGS]
    ref = tmp_path / "ref"
    _codraft(1, f"run_dir={ref}", steps[0], *ARGS)

    run = tmp_path / "cut"
    proc = _launch(4, f"run_dir={run}", *steps)
    _after_first_step(proc, run)
    os.kill(_worker(proc.pid, 3), signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT)
    step = _stopped_at(err, 4, "SIGTERM", run)
    assert 1 <= step < 4 and _checkpoints(run) == [f"step_{step}"]
    assert len(list((run / f"step_{step}" / "sharded").glob("*.distcp"))) == 4
    statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
    assert statuses and set(statuses) == {"143"}, err[-4000:]

    _codraft(4, "--resume", str(run), *steps[1:3])
    assert_same_steps(step_rows(run), step_rows(ref), rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------- spawned ranks


def _signal_during_save(rank, world, policy_dir, run_dir):
    """Rank 1 gets SIGINT inside the second periodic save (step 4): that save completes and the run stops there."""
    from codraft.rl import checkpointing
    from codraft.rl.interrupt import Interrupted
    from codraft.rl.trainer import Trainer
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (a pytest-xdist worker ignores it)
    real, calls = checkpointing.save_shards, []

    def save_shards(parts, folder):
        calls.append(folder)
        if rank == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(parts, folder)
    checkpointing.save_shards = save_shards
    tr = Trainer(run_config(policy_dir, run_dir, 6, extra=["parallel.dp=2"]), progress=False)
    try:
        tr.fit()
    except Interrupted as e:
        return e.exit_code, tr.steps_done
    return None


def test_a_signal_during_a_periodic_save_lets_it_finish(tmp_path, tiny_policy_dir):
    run = tmp_path / "run"
    assert run_ranks(_signal_during_save, 2, tiny_policy_dir, run, timeout=300) == [(130, 4), (130, 4)]
    assert _checkpoints(run) == ["step_2", "step_4"]


def _full_disk(rank, world, policy_dir, run_dir, where):
    """The second checkpoint (step 2) finds the disk full: in rank 1's DCP write, or in rank 0's safetensors."""
    from torch.distributed.checkpoint import filesystem

    import codraft.models.hf_io as hf_io
    from codraft.errors import CodraftError
    from codraft.rl.trainer import Trainer
    if where == "shards" and rank == 1:
        real = filesystem.FileSystem.create_stream

        def create_stream(self, path, mode):
            if "step_2" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(self, path, mode)
        filesystem.FileSystem.create_stream = create_stream
    if where == "consolidated" and rank == 0:
        from safetensors import SafetensorError
        real_save = hf_io.save_file

        def save_file(state, path, **kw):
            if "step_2" in path:
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save(state, path, **kw)
        hf_io.save_file = save_file
    tr = Trainer(run_config(policy_dir, run_dir, 3, extra=["parallel.dp=2", "log.checkpoint_every=1"]), progress=False)
    try:
        tr.fit()
    except CodraftError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("where", ["shards", "consolidated"])
def test_a_full_disk_at_dp2_is_one_line_on_every_rank(tmp_path, tiny_policy_dir, where):
    from codraft.rl.trainer import train
    run = tmp_path / "run"
    results = run_ranks(_full_disk, 2, tiny_policy_dir, run, where, timeout=300)
    for name, message in results:
        assert name == "DiskFullError" and "\n" not in message, message
        assert message.startswith(f"no space left on device writing the checkpoint of step 2 in {run}: it needs "
                                  "about "), message
        assert message.endswith(f"the previous checkpoint {run / 'step_1'} is kept (continue with --resume {run} "
                                "once there is room)"), message
    assert _checkpoints(run) == ["step_1"]
    train(run_config(tiny_policy_dir, run, 3), resume=str(run), progress=False)  # resumes, in one process
    assert _checkpoints(run) == ["step_1", "step_2", "step_3"]
