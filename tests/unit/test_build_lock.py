"""``codraft.atomic.build_lock``: of processes that need the same cache entry (CP/PP ranks each asking for
the offline draft, pytest workers), one builds while the others wait, then find it built; a builder that
dies releases the lock."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from codraft.atomic import build_lock


def _build(root: str, delay: float, die: bool = False):
    root = Path(root)
    with build_lock(root / ".entry.lock", "the entry"):
        if (root / "entry").exists():
            return
        with open(root / "builds.log", "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay)
        if die:
            os._exit(3)  # killed mid-build: no entry, the lock goes with the process
        (root / "entry").write_text("built")


def test_one_process_builds_the_others_wait_and_find_it(tmp_path, capfd):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_build, args=(str(tmp_path), 0.5)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len((tmp_path / "builds.log").read_text().split()) == 1 and (tmp_path / "entry").read_text() == "built"
    assert "another process is building the entry; waiting for it" in capfd.readouterr().err


def test_a_builder_that_dies_releases_the_lock(tmp_path):
    ctx = mp.get_context("fork")
    dying = ctx.Process(target=_build, args=(str(tmp_path), 0.3, True))
    dying.start()
    time.sleep(0.1)  # it holds the lock now
    t0 = time.monotonic()
    _build(str(tmp_path), 0.0)  # waits for it, then builds itself
    dying.join(10)
    assert dying.exitcode == 3 and time.monotonic() - t0 < 10
    assert (tmp_path / "entry").read_text() == "built" and len((tmp_path / "builds.log").read_text().split()) == 2
