"""The rewards usable by name in ``reward.funcs``, run in the trainer's process (codraft's own code):

- ``math``: 1.0 when the completion's final answer is mathematically equal to the answer column (LaTeX,
  fractions, sets, ...; ``math-verify``, the usual reward of math RL), else 0.0;
- ``exact``: 1.0 when the completion, stripped, equals the answer column, stripped;
- ``regex``: 1.0 when the completion, stripped, matches ``reward.regex`` whole (a format reward);
- a built-in task's name (``arith``, ``chain_sum``, ...): that task's own reward against the answer column,
  which is what a task's run scores with (``task.max_chars``, ``task.format_reward`` apply).

Each is a function of (the problem: its answer column, the completion's text) -> float, called per sample.
"""
from __future__ import annotations

import re
from typing import Callable

from codraft.errors import MissingPackageError
from codraft.tasks import TASKS, Problem, make_task

BUILTINS = ("math", "exact", "regex", *TASKS)
READS_ANSWER = ("math", "exact", *TASKS)  # (regex reads the completion only)


def builtin(name: str, cfg, task=None) -> Callable[[Problem, str], float]:
    """The built-in reward ``name`` as ``f(problem, text) -> float`` (``cfg``: the run config; ``task``: the
    run's own task, whose reward a task's name means when it is that task)."""
    if name == "exact":
        return lambda problem, text: float(text.strip() == problem.answer.strip())
    if name == "regex":
        pattern = re.compile(cfg.reward.regex, re.DOTALL)
        return lambda problem, text: float(pattern.fullmatch(text.strip()) is not None)
    if name == "math":
        return _math_verify()
    if task is None or task.name != name:
        task = make_task(name, max_chars=cfg.task.max_chars, format_reward=cfg.task.format_reward)

    def task_reward(problem: Problem, text: str) -> float:
        r, error = task.score(problem, text)  # (a task's score never raises: it hands its error back)
        if error is not None:
            raise error
        return r
    return task_reward


def _math_verify() -> Callable[[str, str], float]:
    try:
        from math_verify import parse, verify
    except ModuleNotFoundError:
        raise MissingPackageError("reward 'math' checks answers with math-verify: pip install math-verify") from None

    def math_reward(problem: Problem, text: str) -> float:
        answer = problem.answer
        gold = parse(answer) or parse(f"${answer}$")  # a bare LaTeX answer ("\\frac{1}{2}") parses inside $...$
        return float(bool(gold) and verify(gold, parse(text)))
    return math_reward
