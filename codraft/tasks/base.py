"""The task contract: `Problem`, `Task` (splits, streams, rewards), answer parsing."""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar, Iterator

SPLITS = ("train", "val")
REWARD_KNOBS = ("max_chars", "format_reward")  # knobs every task has that change only its rewards

# A number as a model may write it once spaces, commas and a leading '$' are dropped.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


@dataclass
class Problem:
    prompt: str  # text the policy is conditioned on (no chat template applied)
    answer: str  # canonical final answer, e.g. "101"
    solution: str  # worked reference completion, ends with the final-answer marker line
    meta: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # the ids the policy is conditioned on, when rendered already (data files);
    #                                      None: the tokenizer's prompt_ids(prompt)


def parse_number(text: str) -> Decimal | None:
    """`text` as an exact decimal, or None when it is not a plain number."""
    s = re.sub(r"[\s,]", "", text)
    if s.startswith("$"):
        s = s[1:]
    elif s[:2] in ("-$", "+$"):
        s = s[0] + s[2:]
    if s.endswith("."):  # a sentence's full stop: "#### 12."
        s = s[:-1]
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def _bucket(prompt: str) -> float:
    """Uniform in [0, 1), a fixed function of the prompt text (stable across processes)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# ---------------------------------------------------------------- interface


class Task(abc.ABC):
    """One RL task. Subclasses are dataclasses whose fields are the task's knobs.

    Every subclass has the knobs `val_fraction`, `max_chars` and `format_reward`.
    """

    name: ClassVar[str]
    marker: ClassVar[str]  # final-answer marker; the answer is the rest of the line after the last one
    val_fraction: float
    max_chars: int
    format_reward: float

    def _check_common(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"{self.name}: val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_chars < 1:
            raise ValueError(f"{self.name}: max_chars must be >= 1, got {self.max_chars}")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"{self.name}: format_reward must be in [0, 1), got {self.format_reward}")

    @property
    def knobs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @property
    def problem_knobs(self) -> dict[str, Any]:
        """The knobs that decide which problems come out (not how they are scored): what data
        computed from a task's problems (a feature cache, an offline draft) depends on."""
        return {k: v for k, v in self.knobs.items() if k not in REWARD_KNOBS}

    # -- problems

    def split_of(self, prompt: str) -> str:
        """The split a prompt belongs to; the same for every seed, so splits never overlap."""
        return "val" if _bucket(prompt) < self.val_fraction else "train"

    @abc.abstractmethod
    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:
        """Endless, deterministic candidate problems; `stream` filters them by split."""

    def stream(self, split: str, seed: int = 0) -> Iterator[Problem]:
        """Endless problems of `split` (repeats possible), deterministic per (split, seed)."""
        _check_split(split)
        return (p for p in self._candidates(split, seed) if self.split_of(p.prompt) == split)

    def sample(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """`n` distinct problems of `split`, deterministic per (split, seed)."""
        _check_split(split)
        out: list[Problem] = []
        seen: set[str] = set()
        budget = 50 * n + 1000  # a tiny problem space must fail loudly, not loop forever
        stream = self.stream(split, seed)
        for _ in range(budget):
            if len(out) == n:
                return out
            p = next(stream)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        if len(out) == n:
            return out
        raise ValueError(f"{self.name}: only {len(out)} distinct {split} problems after {budget} draws "
                         f"(wanted {n}); the knobs {self.knobs} allow too few problems")

    def epoch(self, used: int) -> float | None:
        """Passes over the training prompts after ``used`` of them; None for an endless generator."""
        return None

    def format_completion(self, problem: Problem) -> str:
        """The exact SFT target text (no EOS)."""
        return problem.solution

    # -- rewards

    def extract_answer(self, text: str) -> str | None:
        """Text after the last marker, up to the end of that line; None without a marker."""
        i = text.rfind(self.marker)
        if i < 0:
            return None
        return text[i + len(self.marker):].split("\n", 1)[0]

    def reward(self, problem: Problem, completion: str | bytes) -> float:
        """1.0 correct, `format_reward` well-formed but wrong, 0.0 otherwise. Never raises."""
        return self.score(problem, completion)[0]

    def score(self, problem: Problem, completion: str | bytes) -> tuple[float, Exception | None]:
        """(reward, error): a reward function that raises, or returns NaN/inf, scores 0 and the
        error is handed back (the trainer counts them) instead of killing a training step."""
        try:
            r = float(self._reward(problem, completion))
        except Exception as e:  # noqa: BLE001 - any bug in (user) reward code
            return 0.0, e
        return (r, None) if math.isfinite(r) else (0.0, ValueError(f"non-finite reward {r}"))

    def _reward(self, problem: Problem, completion: str | bytes) -> float:
        if isinstance(completion, (bytes, bytearray)):
            try:
                completion = bytes(completion).decode("utf-8")
            except UnicodeDecodeError:
                return 0.0
        if not isinstance(completion, str) or not completion or len(completion) > self.max_chars:
            return 0.0
        if "\ufffd" in completion:  # a decoder already replaced invalid bytes
            return 0.0
        try:
            completion.encode("utf-8")  # lone surrogates (e.g. from errors="surrogateescape")
        except UnicodeEncodeError:
            return 0.0
        raw = self.extract_answer(completion)
        got = parse_number(raw) if raw is not None else None
        if got is None:
            return 0.0
        want = parse_number(problem.answer)
        return 1.0 if want is not None and got == want else float(self.format_reward)
