"""`gsm_symbolic`: GSM8K-style word problems from `reasoning_gym`, for real models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from codraft.tasks.base import Problem, parse_number
from codraft.tasks.reasoning_gym_base import ReasoningGymTask


@dataclass
class GsmSymbolicTask(ReasoningGymTask):
    """GSM8K-style word problems from `reasoning_gym` ("gsm_symbolic"), integer answers mostly."""

    name: ClassVar[str] = "gsm_symbolic"
    dataset: ClassVar[str] = "gsm_symbolic"
    seed_tag: ClassVar[str] = "gsm"
    marker: ClassVar[str] = "####"
    instruction: str = "End your response with a final line of the form '#### <answer>'."
    chunk: int = 256  # reasoning_gym items generated per dataset
    val_fraction: float = 0.1
    max_chars: int = 4096
    format_reward: float = 0.0

    def __post_init__(self) -> None:
        self._check_common()
        self._check_reasoning_gym()

    def from_entry(self, entry: dict[str, Any], meta: dict[str, Any] | None = None) -> Problem:
        """A Problem from one reasoning_gym entry (question, answer, metadata.answer_cot)."""
        answer = str(entry["answer"]).strip()
        cot = str((entry.get("metadata") or {}).get("answer_cot") or "").strip()
        lines = cot.splitlines()
        final = self.extract_answer(lines[-1]) if lines else None
        if final is None or parse_number(final) is None or parse_number(final) != parse_number(answer):
            lines.append(f"{self.marker} {answer}")  # no usable worked solution: the minimal target
        return Problem(prompt=f"{entry['question'].strip()} {self.instruction}", answer=answer,
                       solution="\n".join(lines), meta=dict(meta or {}))
