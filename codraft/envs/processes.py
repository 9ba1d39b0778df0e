"""Worker processes for user code (tool calls, ``codraft.envs.workers``; reward functions,
``codraft.rewards.worker``): how they start, serve and end, the same for both.

- ``start_context``: forkserver (fast starts: the server imports codraft and the user's module once, and each
  worker is a fork of it), else spawn; both start clean of the trainer's torch state. The server ignores
  SIGTERM, as its workers do (``ignore_stop_signals``): torchrun forwards SIGTERM to each rank's whole
  process group, and a rank that gets it finishes the step in flight, its tool and reward calls included.
- ``serve``: a worker answers jobs from the trainer over its pipe until told to stop or the pipe closes.
- ``kill``: SIGKILL and reap, never an unbounded wait; at exit, workers still running are killed before
  multiprocessing's own hook would SIGTERM them (which they ignore) and wait.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import sys
import threading
import warnings
from multiprocessing import forkserver

START_TIMEOUT_S = 60.0  # a worker process must have loaded the user's code within this
KILL_TIMEOUT_S = 5.0    # a killed worker process must be gone within this
WORKER_NAMES = ("codraft-tool", "codraft-reward")  # the worker processes' names (their own process names)


def kill(process, what: str) -> None:
    """SIGKILL a worker process and reap it; one that outlives KILL_TIMEOUT_S is warned about, never waited on."""
    if process.is_alive():
        process.kill()
        process.join(KILL_TIMEOUT_S)
        if process.is_alive():
            warnings.warn(f"{what} worker process {process.pid} did not exit within {KILL_TIMEOUT_S:g} s of SIGKILL",
                          RuntimeWarning, stacklevel=3)


def _kill_workers_at_exit() -> None:
    """At exit multiprocessing terminates its daemonic children (SIGTERM) and waits for them; the workers ignore
    SIGTERM, so those still running are killed first (registered after multiprocessing's own exit hook, which
    this module imports, so it runs before it)."""
    for p in mp.active_children():
        if p.name in WORKER_NAMES:
            kill(p, "worker")


atexit.register(_kill_workers_at_exit)


def ignore_stop_signals() -> None:
    """A worker process ignores Ctrl-C (SIGINT) and SIGTERM: they are the trainer's to handle. The trainer closes
    or kills its workers, and one left idle exits when the trainer's end of its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def serve(conn, handle, unsendable) -> None:
    """Answer each job from ``conn`` with ``handle(job)`` until told to stop (None) or the trainer is gone; an
    answer that cannot be sent back (it does not pickle) is replaced by ``unsendable(job, answer, error)``."""
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        if job is None:
            return
        out = handle(job)
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - that job's fault, not the worker's end
            conn.send(unsendable(job, out, e))


def start_context(module: str):
    """The multiprocessing context worker processes start from, with ``module`` preloaded where it can be."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(dict.fromkeys(["__main__", "codraft.envs.workers", module])))
    # The server finds those modules on this process's sys.path, given as PYTHONPATH: Python < 3.13 hands it
    # sys.path and drops it, and a module it cannot import is left for each worker to import (slow starts).
    # The server starts ignoring SIGTERM, as the workers it forks do: a SIGTERM to the trainer's process group
    # (torchrun's stop) would end it, and every worker with it. (A disposition can be set from the main thread
    # only; SIGTERM is blocked meanwhile, so one that reaches the trainer then waits for its own handler.)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        forkserver.ensure_running()  # (once running, a no-op)
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx
