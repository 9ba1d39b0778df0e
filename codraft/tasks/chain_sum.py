"""`chain_sum`: short integer sums and differences from `reasoning_gym`, for SmolLM2-135M.

The real-model RL task: SmolLM2-135M-Instruct answers a fair share of these unaided (the
default 2 terms of 1-2 digits: 19 % greedy, 12.5 % at T = 1, docs/real-preset.md), so GRPO has a
reward signal from the first step. Small models explain rather than follow an answer
format, so the answer is the *last number* in the completion: no marker is asked for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from codraft.tasks.base import Problem
from codraft.tasks.reasoning_gym_base import ReasoningGymTask

_LAST_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(\.\d+)?")


@dataclass
class ChainSumTask(ReasoningGymTask):
    """reasoning_gym "chain_sum": e.g. ``State the final answer ...: 41 - 7 + 3 =`` → 37."""

    name: ClassVar[str] = "chain_sum"
    dataset: ClassVar[str] = "chain_sum"
    seed_tag: ClassVar[str] = "chain_sum"
    marker: ClassVar[str] = ""  # unused: the answer is the last number
    min_terms: int = 2
    max_terms: int = 2
    min_digits: int = 1
    max_digits: int = 2
    chunk: int = 256
    val_fraction: float = 0.1
    max_chars: int = 2000
    format_reward: float = 0.0

    def __post_init__(self) -> None:
        self._check_common()
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"chain_sum: need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"chain_sum: need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        self._check_reasoning_gym()

    def dataset_options(self) -> dict[str, Any]:
        return {"min_terms": self.min_terms, "max_terms": self.max_terms,
                "min_digits": self.min_digits, "max_digits": self.max_digits}

    def from_entry(self, entry: dict[str, Any], meta: dict[str, Any] | None = None) -> Problem:
        answer = str(entry["answer"]).strip()
        expression = str((entry.get("metadata") or {}).get("expression") or "").strip()
        solution = f"{expression} = {answer}" if expression else answer
        return Problem(prompt=entry["question"].strip(), answer=answer, solution=solution, meta=dict(meta or {}))

    def extract_answer(self, text: str) -> str | None:
        """The last number in the text (a trailing full stop dropped), or None."""
        found = [m.group(0) for m in _LAST_NUMBER.finditer(text)]
        return found[-1] if found else None
