"""Your reward functions run in a worker process, as your tools do (``codraft.envs.workers``): a function that
hangs past ``reward.timeout``, exits or crashes its process costs that call's samples (scored 0 and counted as
errors), never the run. The worker is then killed and a fresh one started for the next call. One call is one
function on all the samples scored together (a step's, or a validation pass's): a TRL function's one call, a
verl function's calls on each of them, one after the other.

One worker serves every user function of a run: it imports them at start (``calling.load``) and reports their
conventions, or why it cannot (one line: the trainer refuses the run before step 0). It starts from a clean
process (forkserver, else spawn: none of the trainer's torch state), with the trainer's ``sys.path``.
"""
from __future__ import annotations

import sys
import time
from multiprocessing.connection import wait as wait_for

from codraft.envs.processes import KILL_TIMEOUT_S, START_TIMEOUT_S, ignore_stop_signals, kill, serve, \
    start_context
from codraft.rewards.calling import Batch, RewardLoadError, Result, call, load, style_of


class RewardWorker:
    """The worker process of the functions ``specs`` (``FILE.py:NAME`` / ``module:NAME``)."""

    def __init__(self, specs: list[str], timeout: float):
        self.specs, self.timeout = specs, timeout
        self.ctx = start_context(__name__)
        self.process = self.conn = None
        self.styles = self._start()

    def _start(self) -> list[str]:
        """Start the process; -> each function's convention. A worker that cannot load them: RewardLoadError."""
        parent, child = self.ctx.Pipe()
        self.process = self.ctx.Process(target=_serve, args=(child, list(sys.path), self.specs), daemon=True,
                                        name="codraft-reward")
        self.process.start()
        child.close()
        self.conn = parent
        got = self._receive(START_TIMEOUT_S, f"{START_TIMEOUT_S:g} s of loading the reward functions")
        if not (isinstance(got, tuple) and got[0] == "ready"):
            self.close()
            why = got[1] if isinstance(got, tuple) else got
            raise RewardLoadError(why)
        return got[1]

    def call(self, index: int, batch: Batch) -> Result:
        """Function ``index`` on the batch, within ``reward.timeout``; a hang or a dead worker fails every sample."""
        n = len(batch)
        if self.process is None:  # the last call's worker was killed: a fresh one
            try:
                self._start()
            except RewardLoadError as e:
                return Result([None] * n, [f"the reward worker process did not restart: {e}"] * n)
        try:
            self.conn.send((index, batch))
        except OSError:
            pass  # (a dead worker: read below)
        got = self._receive(self.timeout, f"reward.timeout={self.timeout:g} s")
        if isinstance(got, Result):
            return got
        self._kill()
        why = got if isinstance(got, str) else f"unexpected message {got!r}"
        return Result([None] * n, [why] * n)

    def _receive(self, timeout: float, limit: str):
        """The worker's next message, or (text) why there is none: it hung past ``timeout`` (``limit`` says
        which) or died."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer within {limit} (the worker process was killed)"
            ready = wait_for([self.conn, self.process.sentinel], timeout=left)
            try:
                if self.conn in ready or self.conn.poll():
                    return self.conn.recv()
            except (EOFError, OSError):
                pass
            if self.process.sentinel in ready:
                self.process.join(KILL_TIMEOUT_S)
                return f"the reward worker process died (exit code {self.process.exitcode})"

    def _kill(self):
        if self.process is None:
            return
        kill(self.process, "reward")
        self.conn.close()
        self.process = self.conn = None

    def close(self):
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(1.0)
        self._kill()


def _serve(conn, path: list[str], specs: list[str]):
    """The worker process: load the functions, then call them until told to stop or the trainer is gone."""
    ignore_stop_signals()  # Ctrl-C and SIGTERM are the trainer's: a step in flight finishes its scoring
    sys.path[:] = path
    try:
        fns = [load(s) for s in specs]
        styles = [style_of(f, s) for f, s in zip(fns, specs)]
    except RewardLoadError as e:
        conn.send(("broken", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which refuses the run
        conn.send(("broken", f"the reward functions cannot be loaded: {e!r}"))
        return
    conn.send(("ready", styles))

    def answer(job):
        index, batch = job
        return call(fns[index], styles[index], batch)

    def unsendable(job, out, e):  # e.g. a value that does not pickle
        return Result([None] * len(job[1]), [f"the result cannot be sent back: {e!r}"] * len(job[1]))
    serve(conn, answer, unsendable)
