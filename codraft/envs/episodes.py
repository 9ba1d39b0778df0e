"""A batch of episodes against an environment: ``EpisodeBatch`` is the rollout engine's ``Answers``
(``codraft.rollout.turns``) and scores the finished episodes.

Tool calls run on worker threads while the engine decodes the other rows. Each call has ``timeout``
seconds; one that raises, hangs past it, or returns something other than text ends that episode
with reward 0 and counts as an environment error; a tool the environment does not know, or an
observation longer than the room left, ends the episode with its reason. None of them stops the run:
the trainer warns once per step with the first reason. ``latency_ms`` delays every call (a slow
tool), to measure how environment time bounds the end-to-end gain of faster decoding.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, fields

from codraft.envs.base import Environment, EpisodeEnd, ToolFormat
from codraft.rollout.engine import Engine, GenerationResult
from codraft.rollout.turns import run_episodes
from codraft.tasks import Problem

_ENDINGS = {"context": "its observation is longer than the room left in rollout.max_new_tokens",
            "turns": "it reached env.max_turns"}


@dataclass
class Episode(GenerationResult):
    """One finished episode: the engine's result (tokens, logprobs, mask, turns) and how it went."""
    reward: float = 0.0
    reason: str | None = None              # why it ended early (the step's warning), None: it did not
    fault: bool = False                    # an environment fault ended it (raised, hung, not text)
    tool_calls: int = 0
    env_s: float = 0.0                     # seconds inside its tool calls
    reward_error: Exception | None = None  # the reward function failed (scored 0)


class EpisodeBatch:
    def __init__(self, env: Environment, problems: list[Problem], tok, fmt: ToolFormat, *, timeout: float,
                 latency_ms: float = 0.0, workers: int = 8):
        if timeout <= 0:
            raise ValueError(f"env.timeout must be > 0 seconds, got {timeout}")
        self.env, self.problems, self.tok, self.fmt = env, problems, tok, fmt
        self.timeout, self.latency = timeout, latency_ms / 1000
        self.pending = 0
        self.reasons: dict[int, str] = {}
        self.faults: set[int] = set()
        self.calls = [0] * len(problems)
        self.seconds = [0.0] * len(problems)  # (a row has one call at a time: no two threads add to one)
        self._state: dict[int, object] = {}
        self._jobs: dict[int, tuple[int, float]] = {}  # row -> (job id, deadline)
        self._ids = itertools.count()
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._threads = [self._spawn() for _ in range(max(1, workers))]

    def _spawn(self) -> threading.Thread:
        t = threading.Thread(target=self._work, daemon=True, name="codraft-env")  # a hung tool never blocks exit
        t.start()
        return t

    # ---- the engine's side

    def submit(self, row: int, turn: list[int]) -> None:
        job = next(self._ids)
        self._jobs[row] = (job, time.monotonic() + self.timeout)
        self.pending += 1
        self._todo.put((job, row, turn))

    def ready(self, wait: str) -> list[tuple[int, list[int] | None]]:
        out = []
        while True:
            try:
                while True:
                    self._collect(out, *self._done.get_nowait())
            except queue.Empty:
                pass
            now = time.monotonic()
            for row, (_, deadline) in list(self._jobs.items()):
                if now >= deadline:  # hung: its thread is lost, a fresh one takes its place
                    self._end(out, row, f"the environment did not answer within env.timeout={self.timeout:g} s",
                              fault=True)
                    self._threads.append(self._spawn())
            if wait == "none" or not self._jobs or (wait == "any" and out):
                return sorted(out, key=lambda a: a[0])  # (in row order: a run without overlap repeats exactly)
            next_deadline = min(d for _, d in self._jobs.values())
            try:
                self._collect(out, *self._done.get(timeout=max(0.0, next_deadline - time.monotonic())))
            except queue.Empty:
                pass

    def _collect(self, out: list, job: int, row: int, obs, reason: str | None, fault: bool):
        if self._jobs.get(row, (None,))[0] != job:
            return  # the late answer of a call that already timed out
        if reason is not None:
            self._end(out, row, reason, fault)
            return
        del self._jobs[row]
        self.pending -= 1
        out.append((row, obs))

    def _end(self, out: list, row: int, reason: str, fault: bool):
        del self._jobs[row]
        self.pending -= 1
        self.reasons[row] = reason
        if fault:
            self.faults.add(row)
        out.append((row, None))

    def close(self):
        for _ in self._threads:
            self._todo.put(None)

    # ---- the workers

    def _work(self):
        while (item := self._todo.get()) is not None:
            job, row, turn = item
            t0 = time.perf_counter()
            try:
                self._done.put((job, row, self._answer(row, turn), None, False))
            except EpisodeEnd as e:
                self._done.put((job, row, None, str(e), False))
            except Exception as e:  # noqa: BLE001 - any fault of (user) environment code ends that episode only
                self._done.put((job, row, None, f"the environment raised {e!r}", True))
            self.seconds[row] += time.perf_counter() - t0

    def _answer(self, row: int, turn: list[int]) -> list[int] | None:
        call = self.fmt.parse(self.tok.decode(turn))
        if call is None:
            return None  # the policy's final turn
        problem = self.problems[row]
        if row not in self._state:
            self._state[row] = self.env.start(problem)
        if self.latency:
            time.sleep(self.latency)
        self.calls[row] += 1
        result = self.env.call(problem, self._state[row], call)
        if not isinstance(result, str):
            raise TypeError(f"tool {call.name!r} returned {type(result).__name__}, not text")
        return self.tok.encode(self.fmt.render(result))

    # ---- the scores

    def score(self, results: list[GenerationResult]) -> list[Episode]:
        """Each finished episode with its reward from the policy's own text (0 after an environment fault)."""
        self.close()
        out = []
        for row, (problem, res) in enumerate(zip(self.problems, results)):
            reason = self.reasons.get(row, _ENDINGS.get(res.finish_reason))
            own = [t for t, m in zip(res.tokens, res.mask or [True] * len(res.tokens)) if m]
            r, e = (0.0, None) if row in self.faults else _reward(self.env, problem, self.tok.decode(own))
            out.append(Episode(**{f.name: getattr(res, f.name) for f in fields(GenerationResult)}, reward=r,
                               reason=reason, fault=row in self.faults, tool_calls=self.calls[row],
                               env_s=self.seconds[row], reward_error=e))
        return out


def play(engine: Engine, env: Environment, problems: list[Problem], tok, *, prompts: list[list[int]] | None = None,
         max_tokens: int, max_turns: int = 4, timeout: float = 30.0, latency_ms: float = 0.0, workers: int = 8,
         overlap: bool = True, **sampling) -> list[Episode]:
    """One scored episode per problem (``prompts``: their token ids, default the tokenizer's prompt_ids);
    ``sampling``: ``run_episodes``'s temperature, top_p, seed, progress."""
    fmt = ToolFormat.for_tokenizer(tok)
    answers = EpisodeBatch(env, problems, tok, fmt, timeout=timeout, latency_ms=latency_ms, workers=workers)
    try:
        results = run_episodes(engine, prompts or [tok.prompt_ids(p.prompt) for p in problems], answers,
                               max_tokens=max_tokens, max_turns=max_turns, stop=fmt.stop_ids(tok),
                               overlap=overlap, **{"eos_id": tok.eos_id, **sampling})
    finally:
        answers.close()
    return answers.score(results)


def _reward(env: Environment, problem: Problem, text: str) -> tuple[float, Exception | None]:
    try:
        r = float(env.reward(problem, text))
    except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted, as a task's
        return 0.0, e
    return (r, None) if r == r and abs(r) != float("inf") else (0.0, ValueError(f"non-finite reward {r}"))
