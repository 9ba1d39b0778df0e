"""Where tool calls run (``env.isolation``): on threads of the trainer's process (``ThreadTools``) or in
worker processes (``ProcessTools``), so that a tool that exits the process, crashes it or never returns
ends its episode, never the run.

Both pools take ``Job``s (one tool call: the problem, the episode's state, the call) and hand back
``Outcome``s: "ok" (the answer text, already cut to ``max_chars``, and the episode's state), "end" (the
tool ended the episode: ``EpisodeEnd``) or "fault" (it raised, returned something other than text, hung
past its timeout, or its process died). A call's timeout starts when a worker takes it.

- ``ProcessTools``: ``workers`` processes (forkserver, or spawn where there is none: both start clean of
  the trainer's torch state). A call that hangs past its timeout, or whose process dies, is a fault; that
  process is killed and a fresh one takes its place, so the processes stay ``workers``. The environment
  reaches a worker pickled, or, when it does not pickle (tools that are lambdas), as its class and task,
  rebuilt there as ``cls(task)``: either way its class must be importable (defined at a module's top level).
- ``ThreadTools``: a hung call's thread cannot be stopped: it is abandoned, and replaced while at most
  ``workers`` abandoned threads are alive; past that the pool shrinks, and with no thread left every call
  is a fault at once. Threads stay at most 2 × ``workers``.

``tools_for`` keeps one pool per environment object, so workers outlive a batch of episodes (and a hung
call's thread is still counted in the next batch); one batch uses it at a time. ``isolation="auto"`` is
thread for codraft's own pure-Python environments (``calculator``, ``lookup``: nothing to isolate, no
process start) and process for any other (yours).
"""
from __future__ import annotations

import collections
import os
import pickle
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for
from typing import Any

from codraft.envs.base import Environment, EpisodeEnd, ToolCall
from codraft.envs.calculator import Calculator
from codraft.envs.lookup import Lookup
from codraft.envs.processes import KILL_TIMEOUT_S, START_TIMEOUT_S, ignore_stop_signals, kill, serve, \
    start_context
from codraft.errors import CodraftError
from codraft.tasks import Problem

MAX_TIMEOUT_S = 3600    # env.timeout's upper bound: past ~9e9 s the thread and pipe waits overflow
MAX_WORKERS = 256       # env.workers' upper bound (each a thread or a process)
MAX_OBSERVATION_CHARS = 1_000_000  # env.max_observation_chars' upper bound: what a cut is for is a bounded tokeniser


class ToolWorkerError(CodraftError, RuntimeError):
    """Worker processes cannot run this environment (it does not reach them, or they do not start)."""


@dataclass
class Job:
    key: int
    problem: Problem
    state: Any        # the episode's state (ignored when fresh)
    fresh: bool       # the episode's first call: env.start(problem) makes its state
    call: ToolCall
    latency: float    # seconds every call first sleeps (env.latency_ms)
    max_chars: int    # longer answers are cut to this many characters before they leave the worker


@dataclass
class Outcome:
    key: int
    kind: str               # ok | end | fault
    text: str               # the answer (ok) or why the episode ends (end, fault)
    state: Any = None
    cut_from: int = 0       # the answer's length before the cut (0: not cut)
    seconds: float = 0.0    # inside the call


def answer(env: Environment, job: Job) -> Outcome:
    """Run one call (in a worker): the answer cut to ``job.max_chars``, or why its episode ends."""
    t0 = time.perf_counter()
    try:
        state = env.start(job.problem) if job.fresh else job.state
        if job.latency:
            time.sleep(job.latency)
        text = env.call(job.problem, state, job.call)
        if not isinstance(text, str):
            raise TypeError(f"tool {job.call.name!r} returned {type(text).__name__}, not text")
        cut = len(text) if len(text) > job.max_chars else 0
        out = Outcome(job.key, "ok", text[:job.max_chars], state, cut)
    except EpisodeEnd as e:
        out = Outcome(job.key, "end", str(e))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any fault of (user) environment code ends that episode
        out = Outcome(job.key, "fault", f"the environment raised {e!r}")
    out.seconds = time.perf_counter() - t0
    return out


def resolve(env: Environment, isolation: str) -> str:
    """``auto``: thread for codraft's own environments, process for any other."""
    if isolation not in ("auto", "thread", "process"):
        raise ValueError(f"env.isolation must be auto, thread or process, got {isolation!r}")
    if isolation != "auto":
        return isolation
    return "thread" if type(env) in (Calculator, Lookup) else "process"  # (a subclass is your code)


@dataclass(eq=False)
class _Running:
    worker: Any
    job: Job
    started: float
    timeout: float

    @property
    def deadline(self) -> float:
        return self.started + self.timeout


class _Pool:
    """Jobs wait in order for a free worker; a taken job runs until its deadline. Subclasses start, feed,
    read and retire the workers."""
    kind: str

    def __init__(self, workers: int):
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"env.workers must be in [1, {MAX_WORKERS}], got {workers}")
        self.size = workers
        self.idle: list = []
        self.busy: dict[int, _Running] = {}  # job key -> its run
        self.waiting: collections.deque[tuple[Job, float]] = collections.deque()  # (job, timeout)
        self.failed: list[Outcome] = []  # outcomes decided outside a worker (no worker left, not sendable)
        self.replaced = 0  # workers retired for a hung or dead call
        self.closed = False

    def submit(self, job: Job, timeout: float) -> None:
        self.waiting.append((job, timeout))
        self._dispatch()

    def holds(self, keys) -> bool:
        """Are any of these jobs waiting, running or decided and not yet handed out?"""
        return any(k in self.busy for k in keys) or any(j.key in keys for j, _ in self.waiting) or \
            any(o.key in keys for o in self.failed)

    def drop(self, keys) -> None:
        """Forget these jobs (a closed batch's): waiting ones never run, running ones run out."""
        keys = set(keys)
        self.waiting = collections.deque(w for w in self.waiting if w[0].key not in keys)

    def poll(self, wait_s: float) -> list[Outcome]:
        """The calls finished (hung ones included, as faults), waiting up to ``wait_s`` for the first; a
        wait never outlasts the next running call's deadline."""
        until = time.monotonic() + wait_s
        out: list[Outcome] = []
        while True:
            out += self.failed
            self.failed = []
            now = time.monotonic()
            limit = min([until] + [r.deadline for r in self.busy.values()] + self._start_deadlines())
            for worker, got in self._receive(0.0 if out else max(0.0, limit - now)):
                out += self._finish(worker, got)
            now = time.monotonic()
            for key, run in list(self.busy.items()):
                if now >= run.deadline:
                    del self.busy[key]
                    self.replaced += 1
                    out.append(Outcome(key, "fault", f"the environment did not answer within env.timeout="
                                       f"{run.timeout:g} s{self._retire(run.worker)}", seconds=now - run.started))
            self._dispatch()
            out += self.failed
            self.failed = []
            if out or now >= until or not (self.busy or self._start_deadlines()):
                return out

    def _finish(self, worker, got: Outcome | str) -> list[Outcome]:
        """A worker's message: its call's outcome, or (a string) why the worker is gone."""
        key = next((k for k, r in self.busy.items() if r.worker is worker), None)
        if isinstance(got, Outcome):
            if key is not None and got.key == key:
                del self.busy[key]
                self.idle.append(worker)
                return [got]
            return []
        if key is None:  # died idle
            self.idle = [w for w in self.idle if w is not worker]
            self._replace(worker)
            return []
        run = self.busy.pop(key)
        self.replaced += 1
        self._replace(worker)
        return [Outcome(key, "fault", f"{got} during tool {run.job.call.name!r}",
                        seconds=time.monotonic() - run.started)]

    def _dispatch(self):
        while self.waiting and self.idle:
            (job, timeout), worker = self.waiting.popleft(), self.idle.pop(0)
            self.busy[job.key] = _Running(worker, job, time.monotonic(), timeout)
            self._send(worker, job)
        if self.waiting and not self.idle and not self.busy and not self._start_deadlines():
            why = self._no_worker()
            self.failed += [Outcome(job.key, "fault", why) for job, _ in self.waiting]
            self.waiting.clear()

    # ---- per kind
    def _start_deadlines(self) -> list[float]:
        return []

    def _receive(self, wait_s: float) -> list[tuple[object, Outcome | str]]:
        raise NotImplementedError

    def _send(self, worker, job: Job) -> None:
        raise NotImplementedError

    def _retire(self, worker) -> str:
        """Retire a hung worker (and start another where it may); returns what was done, for the reason."""
        raise NotImplementedError

    def _replace(self, worker) -> None:
        """A worker died: start another where it may."""
        raise NotImplementedError

    def _no_worker(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _Thread(threading.Thread):
    def __init__(self, pool: "ThreadTools"):
        super().__init__(daemon=True, name="codraft-tool")  # daemon: a hung tool never blocks exit
        self.pool, self.inbox, self.abandoned = pool, queue.Queue(), False

    def run(self):
        while (job := self.inbox.get()) is not None and not self.abandoned:
            env = self.pool.env()
            out = answer(env, job) if env is not None else Outcome(job.key, "fault", "the environment is gone")
            if self.abandoned:
                return  # given up on at its deadline: its answer is nobody's
            self.pool.done.put((self, out))  # (retired right after: its inbox has the None that ends it)


class ThreadTools(_Pool):
    kind = "thread"

    def __init__(self, env: Environment, workers: int):
        super().__init__(workers)
        self.env = _ref(env)
        self.done: queue.Queue = queue.Queue()
        self.hung: list[_Thread] = []
        self.idle = [self._start() for _ in range(workers)]

    def _start(self) -> _Thread:
        t = _Thread(self)
        t.start()
        return t

    def _receive(self, wait_s):
        got = []
        try:
            got.append(self.done.get(timeout=wait_s) if wait_s > 0 else self.done.get_nowait())
            while True:
                got.append(self.done.get_nowait())
        except queue.Empty:
            pass
        return got

    def _send(self, worker, job):
        worker.inbox.put(job)

    def _retire(self, worker):
        worker.abandoned = True
        worker.inbox.put(None)  # (it ends when its call returns, even one that returns as it is retired)
        self.hung = [t for t in self.hung if t.is_alive()] + [worker]
        if len(self.hung) <= self.size:
            self.idle.append(self._start())
            return " (its thread is abandoned)"
        return f" (its thread is abandoned; {len(self.hung)} tool threads are stuck, none replaced)"

    def _replace(self, worker):
        self.idle.append(self._start())  # (unused: a thread reports no death, a hung one is retired)

    def _no_worker(self):
        return f"every tool thread is stuck in a call that never returned ({len(self.hung)} threads): env.isolation=" \
               "process kills such calls"

    def close(self):
        self.closed = True
        for t in self.idle + [r.worker for r in self.busy.values()] + self.hung:
            t.abandoned = True
            t.inbox.put(None)  # (a hung thread that ever returns reads it and ends)
        self.idle, self.busy, self.hung = [], {}, []


@dataclass(eq=False)
class _Proc:
    process: Any
    conn: Any
    ready_by: float | None  # starting: ready within this (monotonic); None: ready


class ProcessTools(_Pool):
    kind = "process"

    def __init__(self, env: Environment, workers: int):
        super().__init__(workers)
        self.blob = portable(env)
        self.ctx = start_context(type(env).__module__)
        self.starting: list[_Proc] = []
        self.broken: str | None = None
        for _ in range(workers):
            self._start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.starting and not self.broken and time.monotonic() < deadline:
            for worker, got in self._receive(deadline - time.monotonic()):
                if isinstance(got, str):
                    self.broken = self.broken or got
        if self.starting or self.broken:
            self.close()
            why = self.broken or f"{len(self.starting)} of {workers} did not build the environment within " \
                                 f"{START_TIMEOUT_S:g} s"
            raise ToolWorkerError(f"env.isolation=process: the tool worker processes for environment "
                                  f"{env.name!r} did not start: {why}")

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_serve, args=(child, list(sys.path), self.blob), daemon=True, name="codraft-tool")
        p.start()
        child.close()
        self.starting.append(_Proc(p, parent, time.monotonic() + START_TIMEOUT_S))

    def _start_deadlines(self):
        return [w.ready_by for w in self.starting]

    def _receive(self, wait_s):
        workers = self.starting + [r.worker for r in self.busy.values()] + self.idle
        by_handle = {}
        for w in workers:
            by_handle[w.conn] = by_handle[w.process.sentinel] = w
        got, seen = [], set()
        for h in wait_for(list(by_handle), timeout=wait_s):
            w = by_handle[h]
            if id(w) in seen:
                continue
            seen.add(id(w))
            message = None
            try:
                if w.conn.poll():
                    message = w.conn.recv()
            except (EOFError, OSError):
                pass
            if message is None and w.process.is_alive():
                continue  # (the sentinel of a live process cannot be ready: only a late EOF)
            if message is None:
                w.process.join(KILL_TIMEOUT_S)
                message = f"the environment's worker process died (exit code {w.process.exitcode})"
                self._kill(w)
            if w in self.starting:
                self.starting.remove(w)
                if isinstance(message, tuple) and message[0] == "ready":
                    w.ready_by = None
                    self.idle.append(w)
                    continue
                self.broken = message[1] if isinstance(message, tuple) else message
                self._kill(w)
                got.append((w, self.broken))
                continue
            got.append((w, message))
        now = time.monotonic()
        for w in [w for w in self.starting if now >= w.ready_by]:  # a fresh worker that never got ready
            self.starting.remove(w)
            self._kill(w)
            self.broken = f"a fresh worker process did not build the environment within {START_TIMEOUT_S:g} s"
        return got

    def _send(self, worker, job):
        try:
            data = pickle.dumps(job)
        except Exception as e:  # noqa: BLE001 - e.g. an episode state that does not pickle: that episode's fault
            self.busy.pop(job.key)
            self.idle.append(worker)
            self.failed.append(Outcome(job.key, "fault", f"the tool call cannot be sent to a worker process "
                                       f"(its episode state must pickle): {e!r}"))
            return
        try:
            worker.conn.send_bytes(data)
        except OSError:
            pass  # (the worker is gone: its death is read in the next poll)

    def _retire(self, worker):
        self._replace(worker)
        return " (its worker process was killed and replaced)"

    def _replace(self, worker):
        self._kill(worker)
        if not self.broken and not self.closed:
            self._start()

    def _no_worker(self):
        return f"env.isolation=process: no tool worker process: {self.broken}"

    def _kill(self, w: _Proc):
        kill(w.process, "tool")
        w.conn.close()

    def close(self):
        self.closed = True
        for w in self.idle:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.idle:
            w.process.join(1.0)
        for w in self.idle + self.starting + [r.worker for r in self.busy.values()]:
            self._kill(w)
        self.idle, self.starting, self.busy = [], [], {}


def _serve(conn, path: list[str], blob: bytes):
    """A worker process: build the environment, then answer calls until told to stop or the trainer is gone."""
    ignore_stop_signals()
    sys.path[:] = path  # (where the environment's module is found, as in the trainer)
    try:
        cls, x = pickle.loads(blob)
        env = x if cls is None else cls(x)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which refuses the pool
        conn.send(("broken", f"the environment cannot be built in a worker process: {e!r}"))
        return
    conn.send(("ready", os.getpid()))
    serve(conn, lambda job: answer(env, job), lambda job, out, e: Outcome(  # e.g. a state that does not pickle
        job.key, "fault", f"the answer or the episode's state cannot be sent back: {e!r}", seconds=out.seconds))


def portable(env: Environment) -> bytes:
    """The environment as a worker process rebuilds it: pickled whole, or else as its class and task."""
    try:
        return pickle.dumps((None, env))
    except Exception:  # noqa: BLE001 - e.g. tools that are lambdas: rebuilt from its class instead
        pass
    try:
        return pickle.dumps((type(env), env.task))
    except Exception as e:  # noqa: BLE001
        raise ToolWorkerError(
            f"env.isolation=process: environment {getattr(env, 'name', type(env).__name__)!r} reaches a worker "
            f"process pickled, or as its class and task (rebuilt as cls(task)), and neither pickles ({e!r}): "
            "define its class at a module's top level, or set env.isolation=thread") from None


def _ref(env):
    try:
        return weakref.ref(env)
    except TypeError:  # (no weak references: the pool keeps the environment alive)
        return lambda: env


_POOLS: dict[int, _Pool] = {}


def tools_for(env: Environment, isolation: str, workers: int) -> _Pool:
    """The pool of ``env`` (one per environment object, reused across batches while its kind and size hold)."""
    kind = resolve(env, isolation)
    pool = _POOLS.get(id(env))
    if pool is not None and not pool.closed and pool.owner() is env and (pool.kind, pool.size) == (kind, workers):
        return pool
    if pool is not None:
        pool.close()
    pool = (ProcessTools if kind == "process" else ThreadTools)(env, workers)
    pool.owner = _ref(env)
    _POOLS[id(env)] = pool
    try:
        weakref.finalize(env, _forget, id(env), pool)
    except TypeError:
        pass
    return pool


def _forget(key: int, pool: _Pool):
    if _POOLS.get(key) is pool:
        del _POOLS[key]
    pool.close()
