"""Run folders: what counts as a run, the refusal to overwrite one, and the resume record.

A folder holds a run when it has a ``config.yaml``, ``metrics.jsonl``, ``resume_log.jsonl`` or
any ``step_N`` folder. A fresh run never writes into such a folder (``check_fresh``); a resume
needs one (``check_resumable``) and creates nothing when it is missing. Each resume appends a
line to ``resume_log.jsonl``: the step it continued from, the config keys it changed (old and
new value) and the checkpoints it skipped.

One process at a time runs in a folder (``lock_run``, rank 0 under torchrun): a ``flock`` on
``.codraft.lock`` holding the holder's pid, taken before the checks above and held for the run's
life; the OS drops it when the process dies. The lock file alone does not make a folder a run.
Before the lock, ``check_writable`` refuses a folder that cannot be created or written (under a
file, on a read-only file system, without permission), creating nothing.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from pathlib import Path

from codraft.atomic import fsync_dir
from codraft.errors import CodraftError

RUN_FILES = ("config.yaml", "metrics.jsonl", "resume_log.jsonl")
RESUME_LOG = "resume_log.jsonl"
LOCK = ".codraft.lock"  # not in RUN_FILES: a folder holding only the lock holds no run
_STEP = re.compile(r"^step_\d+$")


class RunDirError(CodraftError, ValueError):
    """A run folder that cannot be used as asked (the message says what to do instead)."""


def run_contents(path: str | Path) -> list[str]:
    """The entries of ``path`` that make it a run folder (empty: not a run)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = [n for n in RUN_FILES if (path / n).exists()]
    return found + sorted(p.name for p in path.iterdir() if _STEP.match(p.name))


def checkpoint_of(path: str | Path) -> tuple[Path, str] | None:
    """(the run, the checkpoint's name) when ``path`` is a run's ``step_N`` checkpoint or inside one."""
    path = Path(path).resolve() if ".." in Path(path).parts else Path(path)  # else as the user wrote it
    for p in [path, *path.parents]:
        if _STEP.match(p.name) and run_contents(p.parent):
            return p.parent, p.name
    return None


def _not_a_checkpoint(path: str | Path, flag: str, instead: str):
    """A checkpoint is part of its run, never a run of its own: point at the run folder instead."""
    inside = checkpoint_of(path)
    if inside:
        run, step = inside
        where = "" if Path(path).name == step else "inside "
        raise RunDirError(f"{flag}{path} is {where}checkpoint {step} of the run in {run}: " + instead.format(run=run))


_FRESH = "continue that run with --resume {run}, or start a new run with a run_dir= outside it"


def check_fresh(path: str | Path):
    """A new run may start in ``path`` (absent or without a run); otherwise ``RunDirError``."""
    if Path(path).exists() and not Path(path).is_dir():
        raise RunDirError(f"run_dir={path} is a file, not a folder")
    _not_a_checkpoint(path, "run_dir=", _FRESH)
    found = run_contents(path)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise RunDirError(f"run_dir={path} already holds a run ({shown}); it is never overwritten: "
                          f"continue it with --resume {path}, or start a new run with a new run_dir=")


def check_writable(path: str | Path):
    """``RunDirError`` (one line: the path and why) when ``path`` cannot be created or written; creates nothing."""
    path = Path(path).absolute()
    near = path  # the nearest existing folder on the way to path
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise RunDirError(f"run_dir={path} is a file, not a folder" if near == path else
                          f"run_dir={path} cannot be created: {near} is a file, not a folder")
    if not os.access(near, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if os.statvfs(near).f_flag & os.ST_RDONLY else \
            "is not writable (permission denied)"
        raise RunDirError(f"run_dir={path} cannot be written: {near} {why}")


class RunLock:
    """This process's lock on a run folder (``lock_run``); ``release`` (idempotent) frees it for another run."""

    def __init__(self, fh):
        self._fh = fh

    def release(self):
        if self._fh is not None:
            self._fh.truncate(0)  # no holder: a refused run then leaves the folder byte for byte as it was
            self._fh.close()  # closing drops the flock
            self._fh = None


def lock_run(path: str | Path) -> RunLock | None:
    """Lock run folder ``path`` for this process (created if absent, after ``check_writable``); a folder
    another live process holds is a ``RunDirError`` naming its pid. None where ``flock`` does not exist."""
    _not_a_checkpoint(path, "run_dir=", _FRESH)  # before the lock file would be written into it
    check_writable(path)
    path = Path(path)
    try:
        import fcntl
    except ImportError:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = open(path / LOCK, "a+")
    except OSError as e:  # what check_writable cannot see: /proc, /sys, a full disk
        raise RunDirError(f"run_dir={path} cannot be written: {e.strerror or e}") from e
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        pid = fh.read().strip() or "unknown"
        fh.close()
        raise RunDirError(f"run_dir={path} is in use by another codraft run (pid {pid}); wait for it to end or "
                          "stop it, or use another run_dir=") from None
    fh.truncate(0)  # the pid of a holder that was killed
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return RunLock(fh)


class FreshFolder:
    """What a fresh run adds to ``path``, noted before it creates anything, so a run that stops before any
    step completed can take all of it back (``discard``) and leave no folder that blocks a rerun."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.before = {p.name for p in self.path.iterdir()} if self.path.is_dir() else None  # None: not there
        self.top = next((p for p in reversed([self.path, *self.path.parents]) if not p.exists()), None)

    def discard(self) -> bool:
        """Remove what the run added, and the folder and parents it created; nothing (False) once the folder
        holds a checkpoint."""
        if not self.path.is_dir() or any(_STEP.match(p.name) for p in self.path.iterdir()):
            return False
        for p in self.path.iterdir():
            if self.before is None or p.name not in self.before:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        for p in [self.path, *self.path.parents] if self.top is not None else []:
            if any(p.iterdir()):
                break
            p.rmdir()
            if p == self.top:
                break
        return True


def check_resumable(path: str | Path) -> Path:
    """``path`` as a Path when it holds a run; otherwise ``RunDirError`` (nothing is created)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"--resume {path}: no such folder (nothing was created)")
    _not_a_checkpoint(path, "--resume ", "give the run folder, --resume {run}: a resume continues from the run's "
                                         "latest checkpoint that verifies")
    if not run_contents(path):
        raise RunDirError(f"--resume {path}: the folder holds no codraft run (no config.yaml, metrics.jsonl "
                          "or step_N checkpoint); nothing was changed")
    return path


def append_resume_log(path: str | Path, entry: dict):
    """One line per resume in ``resume_log.jsonl`` (time-stamped)."""
    log = Path(path) / RESUME_LOG
    line = json.dumps({"time": datetime.datetime.now().isoformat(timespec="seconds"), **entry})
    cut = log.is_file() and not log.read_bytes().endswith(b"\n") and log.stat().st_size > 0  # a crash mid-line
    with open(log, "a") as f:
        f.write(("\n" if cut else "") + line + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)


def read_resume_log(path: str | Path) -> list[dict]:
    """The resume records of a run folder (a line cut short by a crash is skipped)."""
    log = Path(path) / RESUME_LOG
    rows = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
