"""A batch of episodes against an environment: ``EpisodeBatch`` is the rollout engine's ``Answers``
(``codraft.rollout.turns``) and scores the finished episodes.

Tool calls run on the environment's workers (``codraft.envs.workers``: threads or processes,
``isolation``) while the engine decodes the other rows. Each call has ``timeout`` seconds; one that
raises, hangs past it, returns something other than text, or kills its worker process ends that episode
with reward 0 and counts as an environment error; a tool the environment does not know, or an
observation longer than the room left, ends the episode with its reason. An answer longer than
``max_observation_chars`` is cut to it before it is tokenised, and counted. None of them stops the run:
the trainer warns once per step with the first reason. ``latency_ms`` delays every call (a slow
tool), to measure how environment time bounds the end-to-end gain of faster decoding.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields

from codraft.envs.base import Environment, ToolFormat
from codraft.envs.workers import MAX_TIMEOUT_S, Job, tools_for
from codraft.rollout.engine import Engine, GenerationResult
from codraft.rollout.turns import run_episodes
from codraft.tasks import Problem

_KEYS = itertools.count()  # tool calls, numbered across batches (a pool outlives its batch)
_ENDINGS = {"context": "its observation is longer than the room left in rollout.max_new_tokens",
            "turns": "it reached env.max_turns"}


@dataclass
class Episode(GenerationResult):
    """One finished episode: the engine's result (tokens, logprobs, mask, turns) and how it went."""
    reward: float | None = 0.0             # None: no reward function judged it (dropped from the step)
    reason: str | None = None              # why it ended early (the step's warning), None: it did not
    fault: bool = False                    # an environment fault ended it (raised, hung, not text)
    tool_calls: int = 0
    observations_cut: int = 0              # tool answers cut to env.max_observation_chars
    env_s: float = 0.0                     # seconds inside its tool calls
    reward_error: Exception | None = None  # a reward function failed (it scored 0; the others count)


class EpisodeBatch:
    def __init__(self, env: Environment, problems: list[Problem], tok, fmt: ToolFormat, *, timeout: float,
                 latency_ms: float = 0.0, workers: int = 8, isolation: str = "auto",
                 max_observation_chars: int = 8192):
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"env.timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout}")
        if max_observation_chars < 1:
            raise ValueError(f"env.max_observation_chars must be >= 1, got {max_observation_chars}")
        self.env, self.problems, self.tok, self.fmt = env, problems, tok, fmt
        self.timeout, self.latency, self.max_chars = timeout, latency_ms / 1000, max_observation_chars
        self.pending = 0
        self.reasons: dict[int, str] = {}
        self.faults: set[int] = set()
        self.calls = [0] * len(problems)
        self.cut = [0] * len(problems)        # observations cut to env.max_observation_chars
        self.seconds = [0.0] * len(problems)
        self._state: dict[int, object] = {}   # row -> its episode's state (after its first call)
        self._jobs: dict[int, int] = {}       # job key -> row
        self._now: list[tuple[int, list[int] | None]] = []  # answers known without a call (final turns)
        self.pool = tools_for(env, isolation, workers)

    # ---- the engine's side

    def submit(self, row: int, turn: list[int]) -> None:
        self.pending += 1
        call = self.fmt.parse(self.tok.decode(turn))
        if call is None:
            self._now.append((row, None))  # the policy's final turn
            return
        self.calls[row] += 1
        key = next(_KEYS)
        self._jobs[key] = row
        self.pool.submit(Job(key, self.problems[row], self._state.get(row), row not in self._state, call,
                             self.latency, self.max_chars), self.timeout)

    def ready(self, wait: str) -> list[tuple[int, list[int] | None]]:
        out, self._now = self._now, []
        self.pending -= len(out)
        while True:
            done = wait == "none" or not self._jobs or (wait == "any" and out)
            got = self.pool.poll(0.0 if done else MAX_TIMEOUT_S)  # (a poll returns by the next deadline)
            if not got and not done and not self.pool.holds(self._jobs):
                raise RuntimeError(f"tool calls of rows {sorted(self._jobs.values())} are lost: their environment's "
                                   "workers were used by another batch of episodes at the same time")
            for o in got:
                row = self._jobs.pop(o.key, None)
                if row is None:
                    continue  # a call of a batch closed before it answered
                self.pending -= 1
                self.seconds[row] += o.seconds
                if o.kind == "ok":
                    self._state[row] = o.state
                    self.cut[row] += o.cut_from > 0
                    out.append((row, self.tok.encode(self.fmt.render(o.text))))  # (cut before it is tokenised)
                else:
                    self.reasons[row] = o.text
                    if o.kind == "fault":
                        self.faults.add(row)
                    out.append((row, None))
            if wait == "none" or not self._jobs or (wait == "any" and out):
                return sorted(out, key=lambda a: a[0])  # (in row order: a run without overlap repeats exactly)

    def close(self):
        """Calls not yet answered are forgotten (the pool outlives the batch: it is the environment's)."""
        self.pool.drop(self._jobs)
        self._jobs.clear()

    # ---- the scores

    def score(self, results: list[GenerationResult]) -> list[Episode]:
        """Each finished episode with its reward from the policy's own text (0 after an environment fault; None
        where no reward function judged it)."""
        self.close()
        own = [[t for t, m in zip(res.tokens, res.mask or [True] * len(res.tokens)) if m] for res in results]
        rows = [r for r in range(len(results)) if r not in self.faults]
        texts = [self.tok.decode(own[r]) for r in rows]
        scored = dict(zip(rows, self.env.score([self.problems[r] for r in rows], texts, [own[r] for r in rows])))
        out = []
        for row, (problem, res) in enumerate(zip(self.problems, results)):
            reason = self.reasons.get(row, _ENDINGS.get(res.finish_reason))
            r, e = scored.get(row, (0.0, None))
            out.append(Episode(**{f.name: getattr(res, f.name) for f in fields(GenerationResult)}, reward=r,
                               reason=reason, fault=row in self.faults, tool_calls=self.calls[row],
                               observations_cut=self.cut[row], env_s=self.seconds[row], reward_error=e))
        return out


def play(engine: Engine, env: Environment, problems: list[Problem], tok, *, prompts: list[list[int]] | None = None,
         max_tokens: int, max_turns: int = 4, timeout: float = 30.0, latency_ms: float = 0.0, workers: int = 8,
         overlap: bool = True, isolation: str = "auto", max_observation_chars: int = 8192, **sampling) -> list[Episode]:
    """One scored episode per problem (``prompts``: their token ids, default ``prompt_ids``);
    ``sampling``: ``run_episodes``'s temperature, top_p, seed, progress."""
    fmt = ToolFormat.for_tokenizer(tok)
    answers = EpisodeBatch(env, problems, tok, fmt, timeout=timeout, latency_ms=latency_ms, workers=workers,
                           isolation=isolation, max_observation_chars=max_observation_chars)
    try:
        results = run_episodes(engine, prompts or [prompt_ids(env, tok, p) for p in problems], answers,
                               max_tokens=max_tokens, max_turns=max_turns, stop=fmt.stop_ids(tok),
                               overlap=overlap, **{"eos_id": tok.eos_id, **sampling})
    finally:
        answers.close()
    return answers.score(results)


def prompt_ids(env: Environment, tok, problem: Problem) -> list[int]:
    """The ids an episode starts from: the environment's own prompt (its tools' schemas in it), else the
    problem's rendered ids, else the tokenizer's prompt."""
    ids = env.prompt_ids(tok, problem)
    if ids is not None:
        return ids
    return problem.prompt_ids if getattr(problem, "prompt_ids", None) is not None else tok.prompt_ids(problem.prompt)
