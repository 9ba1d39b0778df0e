"""`gsm_symbolic`: GSM8K-style word problems from `reasoning_gym`, for real models."""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from codraft.tasks.base import Problem, Task, parse_number


def _require_reasoning_gym() -> None:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError("task 'gsm_symbolic' needs the reasoning-gym package: "
                          "pip install reasoning-gym  (or pip install 'codraft[real]')")


@dataclass
class GsmSymbolicTask(Task):
    """GSM8K-style word problems from `reasoning_gym` ("gsm_symbolic"), integer answers mostly.

    Problems are generated in chunks; each chunk is a reasoning_gym dataset whose seed is
    derived from (split, seed, chunk) by hashing, so chunks do not share generator streams
    (reasoning_gym seeds item i with seed + i, so adjacent plain seeds would overlap).
    """

    name: ClassVar[str] = "gsm_symbolic"
    marker: ClassVar[str] = "####"
    instruction: str = "End your response with a final line of the form '#### <answer>'."
    chunk: int = 256  # reasoning_gym items generated per dataset
    val_fraction: float = 0.1
    max_chars: int = 4096
    format_reward: float = 0.0

    def __post_init__(self) -> None:
        self._check_common()
        if self.chunk < 1:
            raise ValueError(f"gsm_symbolic: chunk must be >= 1, got {self.chunk}")
        _require_reasoning_gym()

    def _rg_seed(self, split: str, seed: int, chunk: int) -> int:
        digest = hashlib.sha256(f"codraft.gsm/{split}/{seed}/{chunk}".encode()).digest()
        return int.from_bytes(digest[:4], "big") >> 1  # 31 bits: any int works, keep it small

    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:
        import reasoning_gym  # lazy: only this task needs it

        c = 0
        while True:
            rg_seed = self._rg_seed(split, seed, c)
            for i, entry in enumerate(reasoning_gym.create_dataset("gsm_symbolic", size=self.chunk, seed=rg_seed)):
                yield self.from_entry(entry, meta={"rg_seed": rg_seed, "rg_index": i})
            c += 1

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
