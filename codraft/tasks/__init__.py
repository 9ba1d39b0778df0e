"""Tasks that RL optimises: seeded problem generators, SFT targets, and verifiable rewards.

A task hands out `Problem`s (prompt, canonical answer, worked reference solution) for the
"train" and "val" splits and scores a completion with `reward(problem, completion)`:

- `arith` — synthetic multi-step integer arithmetic for the tiny character-level preset.
  Prompt `17+23*4-8=`, completion `17+23*4-8=17+92-8=109-8=101#101` (then EOS): the
  expression restated, then rewritten after each single operation (style "rewrite", the
  default), or the operations listed, `23*4=92;17+92=109;109-8=101#101` (style "steps").
  Usual precedence: every product/quotient term is worked first, left to right, then the
  +/- chain left to right; the final answer follows the last `#`.
- `arith_haystack` — long `arith` contexts with distractors, for long-context runs: the prompt
  is `context_chars` characters (default 4096, up to 32768) of worked `arith` problems, one per
  line, then the `arith` question on the last line (`layout="both"`: also once first). Answer,
  SFT target and reward are the question's `arith` ones; its split is its question's.
- `gsm_symbolic` — GSM8K-style word problems from `reasoning_gym` for real models; the
  prompt asks for a final line `#### <number>`, the SFT target is the dataset's worked
  solution (it already ends with that line).
- `lookup` — questions over a table of employees, departments and budgets, answered with tools
  (the `lookup` environment, `codraft.envs`): `ann+3=` is the budget of ann's department plus 3.
- `chain_sum` — short sums/differences from `reasoning_gym` (2 terms of 1-2 digits by
  default) for SmolLM2-135M, which scores 19 % unaided (greedy); the answer is the last number in
  the completion (small models do not keep to a marker format).

Splits never overlap: a prompt's split is a fixed function of its text (a SHA-256 bucket),
and each split's generator keeps only prompts whose bucket is its own. Generation is
deterministic per (split, seed) and independent of `PYTHONHASHSEED`.

Rewards: 1.0 when the number after the LAST final-answer marker equals the canonical answer
(spaces, commas and a leading `$` ignored; "42.0" == "42"); `format_reward` (default 0)
when a well-formed number follows the marker but is wrong; 0.0 for everything else: no
marker, empty, longer than `max_chars`, bytes that are not UTF-8, strings carrying
surrogates or U+FFFD, or any other input. `reward` never raises.

Left out: tokenisation and EOS (the SFT target text carries no EOS; the caller's tokenizer
appends it), chat templates (the tokenizer's `prompt_ids`), batching, and answer formats
other than the marker (no `\\boxed{}`, no LaTeX).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from codraft.tasks.arith import ArithTask
from codraft.tasks.arith_haystack import ArithHaystackTask
from codraft.tasks.base import SPLITS, Problem, Task, parse_number
from codraft.tasks.chain_sum import ChainSumTask
from codraft.tasks.gsm import GsmSymbolicTask
from codraft.tasks.lookup import LookupTask

TASKS: dict[str, type[Task]] = {"arith": ArithTask, "arith_haystack": ArithHaystackTask, "chain_sum": ChainSumTask,
                                "gsm_symbolic": GsmSymbolicTask, "lookup": LookupTask}


def make_task(name: str, **knobs: Any) -> Task:
    """Build a task by name; unknown names or knobs are errors that list the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise ValueError(f"unknown knob(s) for task {name!r}: {', '.join(unknown)}; valid: {', '.join(valid)}")
    return cls(**knobs)


__all__ = ["SPLITS", "TASKS", "ArithHaystackTask", "ArithTask", "ChainSumTask", "GsmSymbolicTask", "LookupTask", "Problem", "Task", "make_task",
           "parse_number"]
