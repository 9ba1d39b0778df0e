"""The run folder against the file system, other runs and Ctrl-C, with real processes: a folder that cannot
be written is refused before anything loads; of two runs started into one folder, the second is refused
naming the first's pid (a killed holder frees it; CP ranks beside a refused rank 0 fail in bounded time);
two Ctrl-Cs during a checkpoint write keep the checkpoint and print where the run stopped."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_checkpoint import _cli_run
from tiny_runs import run_config

from codraft.rl import trainer as trainer_mod
from codraft.rl.logger import read_metrics
from codraft.train import checkpoint as ckpt
from codraft.train.run_dir import LOCK, check_fresh, lock_run, run_contents
from dist_harness import run_ranks

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _codraft(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "codraft", *args], env=ENV, capture_output=True, text=True,
                          timeout=300)


def _wait(cond, what: str, proc: subprocess.Popen, err, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _no_load(*a, **k):
    raise AssertionError("loaded a policy before refusing the run folder")


# ---------------------------------------------------------------- a folder that cannot be written


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc paths")
def test_an_unwritable_run_dir_is_refused_before_anything_loads(tmp_path, tiny_policy_dir, monkeypatch):
    """Root writes through permission bits, so the cases are ones root cannot write either: under a regular
    file, /proc/sys (procfs refuses writes to it, os.access says so) and /proc (mkdir itself fails)."""
    from codraft.cli import main
    monkeypatch.setattr(trainer_mod, "load_policy", _no_load)
    (tmp_path / "file").write_text("")
    for run, why in ((tmp_path / "file" / "run", f"cannot be created: {tmp_path / 'file'} is a file, not a folder"),
                     (tmp_path / "file", "is a file, not a folder"),
                     ("/proc/sys/codraft-run", "cannot be written: /proc/sys is not writable (permission denied)"),
                     ("/proc/codraft-run", "cannot be written: No such file or directory")):
        with pytest.raises(SystemExit) as stop:
            main(_cli_run(tiny_policy_dir, run))
        assert str(stop.value.code) == f"codraft train: error: run_dir={run} {why}"
    assert (tmp_path / "file").read_text() == "" and not os.path.exists("/proc/codraft-run")


def _unshare_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -m (root with CAP_SYS_ADMIN) for a read-only mount")
def test_a_run_dir_on_a_read_only_file_system_is_refused(tmp_path):
    """A real read-only file system: a tmpfs mounted read-only in a private mount namespace (gone with the
    process). policy.init does not exist, so a check that came after loading would print that error instead."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = 'mount -t tmpfs -o ro tmpfs "$1" && exec "$2" -m codraft train policy.init="$1/missing" run_dir="$1/run"'
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(ro), sys.executable], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"codraft train: error: run_dir={ro}/run cannot be written: {ro} is on a read-only file system"]
    assert not list(ro.iterdir())


# ---------------------------------------------------------------- one run per folder


def test_a_second_run_is_refused_naming_the_first_and_a_killed_run_frees_the_folder(tmp_path, tiny_policy_dir):
    """Run A trains into the folder (then stopped, SIGSTOP); B (fresh, then --resume) is refused naming A's pid
    and leaves A alone. A killed with SIGKILL: the OS drops its lock (its pid is still in the file) and a resume
    takes it."""
    run = tmp_path / "run"
    with open(tmp_path / "a.err", "w") as err:
        a = subprocess.Popen([sys.executable, "-m", "codraft", *_cli_run(tiny_policy_dir, run, steps=100_000)],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait(lambda: ckpt.latest_checkpoint(run) is not None, "first checkpoint", a, tmp_path / "a.err")
        a.send_signal(signal.SIGSTOP)  # A holds the folder, idle (its training would only load the machine)
        assert (run / LOCK).read_text() == f"{a.pid}\n"
        for args in (_cli_run(tiny_policy_dir, run, steps=5), ["train", "--resume", str(run)]):
            b = _codraft(*args)
            assert (b.returncode, b.stderr.strip().splitlines()) == (1, [
                f"codraft train: error: run_dir={run} is in use by another codraft run (pid {a.pid}); wait for it "
                "to end or stop it, or use another run_dir="])
        assert a.poll() is None  # A runs on
    finally:
        a.kill()
        a.wait()
    assert (run / LOCK).read_text() == f"{a.pid}\n"
    last = int(ckpt.latest_checkpoint(run).name.removeprefix("step_"))
    done = _codraft("train", "--resume", str(run), f"steps={last + 1}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ckpt.latest_checkpoint(run).name == f"step_{last + 1}" and (run / LOCK).read_text() == ""


def test_a_run_that_fails_to_start_leaves_a_folder_a_rerun_takes(tmp_path, tiny_policy_dir):
    """The folder is locked before the policy loads; a failure then releases the lock, in the same process
    too while the error (its traceback, holding the failed trainer) is kept, as a REPL keeps the last one;
    and the lock file alone does not make the folder a run."""
    from codraft.cli import main
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match="neither a known name") as failed:
        main(["train", f"policy.init={tmp_path / 'missing'}", f"run_dir={run}", "steps=1"])
    assert [p.name for p in run.iterdir()] == [LOCK] and run_contents(run) == []
    check_fresh(run)
    main(_cli_run(tiny_policy_dir, run, steps=1))
    assert ckpt.latest_checkpoint(run) == run / "step_1" and failed.value.code != 0


def _cp_ranks_into_a_held_folder(rank, world, policy_dir, run, late=False):
    """Both CP ranks start a run into a folder another process holds: rank 0 is refused, rank 1 must not hang.
    ``late``: rank 1 starts making the device mesh 3 s after rank 0 (as a loaded machine may schedule it)."""
    from codraft.rl.trainer import Trainer
    if late and rank == 1:
        from codraft.parallel import mesh
        made = mesh.init_device_mesh
        mesh.init_device_mesh = lambda *a, **k: (time.sleep(3), made(*a, **k))[1]
    t0 = time.monotonic()
    try:
        Trainer(run_config(policy_dir, run, 1, extra=["parallel.cp=2", "parallel.timeout=20"]), progress=False)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("late", [False, True], ids=["together", "rank-1-late"])
def test_cp_ranks_beside_a_refused_rank_0_fail_within_the_timeout(tmp_path, tiny_policy_dir, late):
    run = tmp_path / "run"
    held = lock_run(run)  # this test process is the other run
    try:
        out = run_ranks(_cp_ranks_into_a_held_folder, 2, str(tiny_policy_dir), str(run), late, timeout=120)
    finally:
        held.release()
    (e0, msg0, _), (e1, msg1, seconds1) = out
    assert (e0, msg0) == ("RunDirError", f"run_dir={run} is in use by another codraft run (pid {os.getpid()}); "
                                         "wait for it to end or stop it, or use another run_dir=")
    assert e1 == "PeerError" and "the run folder (rank 0 may have refused it: see its error)" in msg1
    assert seconds1 < 20 + 10


# ---------------------------------------------------------------- Ctrl-C twice during a checkpoint write

# `codraft train` whose checkpoint writes take 3 s (each announced in the file argv[1]), under a SIGINT handler
# as from a terminal (pytest-xdist workers ignore SIGINT, and a child inherits that)
SLOW_SAVES = r"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from codraft.train import checkpoint
real = checkpoint.save_pretrained

def slow(*a, **k):
    with open(sys.argv[1], "a") as f:
        f.write("save\n")
    time.sleep(3)
    return real(*a, **k)

checkpoint.save_pretrained = slow
from codraft.cli import main
main(sys.argv[2:])
"""


def _steps_done(run) -> int:
    try:
        return max((r["step"] for r in read_metrics(run) if "reward_mean" in r), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("when", ["scheduled", "on_ctrl_c"])
def test_two_ctrl_c_during_a_checkpoint_write_keep_it_and_say_where(tmp_path, tiny_policy_dir, when):
    """scheduled: both SIGINTs land in the write of step 1's checkpoint (log.checkpoint_every=1), which must
    complete. on_ctrl_c: no scheduled checkpoints; a first SIGINT mid-run starts the write of the last completed
    step, and two more land in it. Either way the run ends (exit 130) saying the step on disk."""
    run, saves, err = tmp_path / "run", tmp_path / "saves", tmp_path / "err"
    args = [a for a in _cli_run(tiny_policy_dir, run, steps=100_000) if not a.startswith("log.checkpoint_every=")]
    args.append(f"log.checkpoint_every={int(when == 'scheduled')}")
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-c", SLOW_SAVES, str(saves), *args], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=f)
    try:
        if when == "on_ctrl_c":
            _wait(lambda: _steps_done(run) >= 1, "completed step", p, err)
            p.send_signal(signal.SIGINT)
        _wait(saves.is_file, "checkpoint write", p, err)
        for _ in range(2):
            time.sleep(0.5)
            p.send_signal(signal.SIGINT)
        p.wait(120)
    finally:
        p.kill()
        p.wait()
    last = ckpt.latest_checkpoint(run)
    assert p.returncode == 130 and last is not None and ckpt.verify(last) is None, err.read_text()[-3000:]
    assert f"interrupted after step {last.name.removeprefix('step_')} by SIGINT; latest checkpoint: {last}" \
        in err.read_text()
    assert saves.read_text() == "save\n"  # one write, completed
    if when == "scheduled":
        assert last.name == "step_1"  # the step being saved
    assert not [q.name for q in run.iterdir() if q.name.startswith(".step_")]  # no temporaries left
