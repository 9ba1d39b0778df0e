"""Run folders: what counts as a run, the refusal to overwrite one, and the resume record.

A folder holds a run when it has a ``config.yaml``, ``metrics.jsonl``, ``resume_log.jsonl`` or
any ``step_N`` folder. A fresh run never writes into such a folder (``check_fresh``); a resume
needs one (``check_resumable``) and creates nothing when it is missing. Each resume appends a
line to ``resume_log.jsonl``: the step it continued from, the config keys it changed (old and
new value) and the checkpoints it skipped.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

from codraft.atomic import fsync_dir

RUN_FILES = ("config.yaml", "metrics.jsonl", "resume_log.jsonl")
RESUME_LOG = "resume_log.jsonl"
_STEP = re.compile(r"^step_\d+$")


class RunDirError(ValueError):
    """A run folder that cannot be used as asked (the message says what to do instead)."""


def run_contents(path: str | Path) -> list[str]:
    """The entries of ``path`` that make it a run folder (empty: not a run)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = [n for n in RUN_FILES if (path / n).exists()]
    return found + sorted(p.name for p in path.iterdir() if _STEP.match(p.name))


def check_fresh(path: str | Path):
    """A new run may start in ``path`` (absent or without a run); otherwise ``RunDirError``."""
    if Path(path).exists() and not Path(path).is_dir():
        raise RunDirError(f"run_dir={path} is a file, not a folder")
    found = run_contents(path)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise RunDirError(f"run_dir={path} already holds a run ({shown}); it is never overwritten: "
                          f"continue it with --resume {path}, or start a new run with a new run_dir=")


def check_resumable(path: str | Path) -> Path:
    """``path`` as a Path when it holds a run; otherwise ``RunDirError`` (nothing is created)."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"--resume {path}: no such folder (nothing was created)")
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
