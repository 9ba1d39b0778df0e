"""The run's reward: its functions (``reward.funcs``), their weights, and how their values combine.

A sample's reward is Σ_k w_k · r_k over the functions k that judged it (r_k not None). A function that fails
on a sample (raises, hangs past ``reward.timeout``, returns the wrong number of values or something that is
not a finite number) scores it 0 there and is counted (``Scores.errors``). A sample no function judged (every
one returned None) has no reward: it is dropped from the step (``Scores.totals`` holds None; see
``codraft.rl.scoring``). Without ``reward.funcs``, a built-in task's run scores with the task's own reward:
the same machinery, one function named after the task.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from codraft.data.file_task import DataProblem
from codraft.errors import CodraftError
from codraft.rewards.builtin import BUILTINS, READS_ANSWER, builtin
from codraft.rewards.calling import Batch, RewardLoadError, Result, call, load, style_of
from codraft.rewards.worker import RewardWorker
from codraft.tasks import Problem


class RewardError(CodraftError, ValueError):
    """A reward function that cannot be used: not found, not loadable, a signature of neither convention."""


@dataclass
class Scores:
    totals: list               # each sample's weighted sum, or None (no function judged it: dropped)
    per_function: dict         # name -> each sample's value (None: not judged; failures score 0)
    errors: list[str]          # one line per failed (function, sample): "NAME: error"


@dataclass
class RewardFn:
    name: str                  # in the metrics: reward/NAME_mean
    weight: float
    run: Callable[[list, Batch], Result]


def parse_funcs(text: str) -> list[str]:
    """``reward.funcs`` (comma-separated) -> its items; empty: none."""
    return [s.strip() for s in text.split(",")] if text.strip() else []


def parse_weights(text: str) -> list[float]:
    return [float(s) for s in text.split(",")] if text.strip() else []


class RewardSet:
    """Score batches of completions with the run's functions (built-ins in this process, yours in a worker)."""

    def __init__(self, fns: list[RewardFn], worker: RewardWorker | None = None):
        self.fns, self.worker = fns, worker
        if worker is not None:  # the worker process goes with the reward set
            weakref.finalize(self, worker.close)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fns]

    def score(self, problems: list[Problem], texts: list[str], completion_ids: list[list[int]]) -> Scores:
        batch = make_batch(problems, texts, completion_ids)
        n = len(texts)
        totals, per_function, errors = [None] * n, {}, []
        for f in self.fns:
            got = f.run(problems, batch)
            values = list(got.values)
            for i, e in enumerate(got.errors):
                if e is not None:
                    values[i] = 0.0
                    errors.append(f"{f.name}: {e}")
            per_function[f.name] = values
            for i, v in enumerate(values):
                if v is not None:
                    totals[i] = (0.0 if totals[i] is None else totals[i]) + f.weight * v
        return Scores(totals, per_function, errors)

    def close(self):
        if self.worker is not None:
            self.worker.close()


class ScoredOnce:
    """A reward set over several ranks that all need the same batch's scores (the trainer's step and its
    validation): rank 0 runs the functions on the whole batch and every rank gets its ``Scores`` through
    ``world`` (a group with ``rank``, ``size`` and ``all_gather_object``), so each function runs once per sample
    and every rank has rank 0's values, whatever a function does (a judge that answers differently, a timeout on
    one rank). With one process (``world`` None) it is the reward set itself."""

    def __init__(self, rewards: RewardSet, world=None):
        self.rewards, self.world = rewards, world

    @property
    def names(self) -> list[str]:
        return self.rewards.names

    def score(self, problems: list[Problem], texts: list[str], completion_ids: list[list[int]]) -> Scores:
        if self.world is None or self.world.size == 1:
            return self.rewards.score(problems, texts, completion_ids)
        mine = self.rewards.score(problems, texts, completion_ids) if self.world.rank == 0 else None
        return self.world.all_gather_object(mine, "rank 0's reward scores")[0]


def make_batch(problems: list[Problem], texts: list[str], completion_ids: list[list[int]]) -> Batch:
    """The samples as reward functions see them: data rows give their own prompt and columns; a built-in
    task's problems give their prompt text and the columns answer, solution and their meta."""
    prompts, completions, columns = [], [], []
    for p, t in zip(problems, texts):
        if isinstance(p, DataProblem):
            prompts.append(p.raw_prompt)
            completions.append([{"role": "assistant", "content": t}] if isinstance(p.raw_prompt, list) else t)
            columns.append(p.meta)
        else:
            prompts.append(p.prompt)
            completions.append(t)
            columns.append({"answer": p.answer, "solution": p.solution, **p.meta})
    return Batch(prompts, completions, list(texts), [list(map(int, c)) for c in completion_ids], columns,
                 [p.answer for p in problems])


def build_rewards(cfg, task) -> RewardSet:
    """The run's reward set: ``reward.funcs`` with ``reward.weights``, or the task's own reward."""
    r = cfg.reward
    specs = parse_funcs(r.funcs) or [task.name]
    weights = parse_weights(r.weights) or [1.0] * len(specs)
    if len(weights) != len(specs):
        raise RewardError(f"config key 'reward.weights' must give one weight per function of reward.funcs "
                          f"({len(specs)}), got {len(weights)}")
    names = _names(specs)
    mine = [s for s in specs if ":" in s]
    inline = r.isolation == "inline" or not mine
    for s in specs:
        if ":" not in s and s not in BUILTINS:
            raise RewardError(f"reward.funcs: unknown reward {s!r}; built in: {', '.join(BUILTINS)}, or give "
                              f"FILE.py:NAME or module:NAME")
        if s in READS_ANSWER and getattr(task, "train", None) and not any(p.answer for p in task.train):
            raise RewardError(f"reward.funcs: {s!r} compares completions with an answer column (answer, "
                              f"ground_truth, reward_model.ground_truth or solution) and {task.knobs['train']} has "
                              f"none; its columns: {', '.join(task.train[0].meta) or '(only the prompt)'}")
    worker = None
    if mine and not inline:
        try:
            worker = RewardWorker(mine, r.timeout)
        except RewardLoadError as e:
            raise RewardError(f"reward.funcs: {e}") from None
    fns = []
    for spec, name, w in zip(specs, names, weights):
        if ":" not in spec:
            fns.append(RewardFn(name, w, _per_sample(builtin(spec, cfg, task))))
        elif worker is not None:
            fns.append(RewardFn(name, w, _in_worker(worker, mine.index(spec))))
        else:
            try:
                fn = load(spec)
                style = style_of(fn, spec)
            except RewardLoadError as e:
                raise RewardError(f"reward.funcs: {e}") from None
            fns.append(RewardFn(name, w, lambda problems, batch, fn=fn, style=style: call(fn, style, batch)))
    return RewardSet(fns, worker)


def _names(specs: list[str]) -> list[str]:
    """Each function's metric name: its NAME (a built-in's own), numbered from the second of a name on."""
    names = []
    for s in specs:
        base = s.rpartition(":")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def _per_sample(fn: Callable[[Problem, str], float]) -> Callable[[list, Batch], Result]:
    """A built-in (problem, text) -> float over a batch; a sample that raises is that sample's error."""
    def run(problems: list, batch: Batch) -> Result:
        out = Result([None] * len(batch), [None] * len(batch))
        for i, (p, t) in enumerate(zip(problems, batch.texts)):
            try:
                out.values[i] = float(fn(p, t))
            except Exception as e:  # noqa: BLE001
                out.errors[i] = repr(e)
        return out
    return run


def _in_worker(worker: RewardWorker, index: int) -> Callable[[list, Batch], Result]:
    return lambda problems, batch: worker.call(index, batch)
