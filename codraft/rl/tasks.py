"""Tasks that RL optimises: seeded problem generators, SFT targets, and verifiable rewards.

A task hands out `Problem`s (prompt, canonical answer, worked reference solution) for the
"train" and "val" splits and scores a completion with `reward(problem, completion)`:

- `arith` — synthetic multi-step integer arithmetic for the tiny character-level preset.
  Prompt `17+23*4-8=`, completion `17+23*4-8=17+92-8=109-8=101#101` (then EOS): the
  expression restated, then rewritten after each single operation (style "rewrite", the
  default), or the operations listed, `23*4=92;17+92=109;109-8=101#101` (style "steps").
  Usual precedence: every product/quotient term is worked first, left to right, then the
  +/- chain left to right; the final answer follows the last `#`.
- `gsm_symbolic` — GSM8K-style word problems from `reasoning_gym` for real models; the
  prompt asks for a final line `#### <number>`, the SFT target is the dataset's worked
  solution (it already ends with that line).

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

import abc
import dataclasses
import hashlib
import importlib.util
import math
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar, Iterator

SPLITS = ("train", "val")

# A number as a model may write it once spaces, commas and a leading '$' are dropped.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


@dataclass
class Problem:
    prompt: str  # text the policy is conditioned on (no chat template applied)
    answer: str  # canonical final answer, e.g. "101"
    solution: str  # worked reference completion, ends with the final-answer marker line
    meta: dict[str, Any] = field(default_factory=dict)


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


# ---------------------------------------------------------------- arith


def _int_with_digits(rng: random.Random, digits: int, low1: int) -> int:
    """A random integer with exactly `digits` digits; one-digit numbers start at `low1`."""
    if digits == 1:
        return rng.randint(low1, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


@dataclass
class ArithTask(Task):
    """Multi-step integer arithmetic with a worked solution, for a character-level model.

    An expression is a +/- chain of terms; a term is a number or a product/quotient of two
    numbers (a quotient is always exact). Defaults (4-5 one-digit operands, at least one
    product, every value shown in 0..9) give prompts of ~9 chars and completions of ~26
    chars. They are calibrated so the tiny preset's sub-3-minute warm start lands well
    above 30 % but well below 100 % held-out accuracy (RL has room; with values up to 20,
    numbers of varying width, it reached only 15-25 %); raise the knobs for harder variants.
    With these defaults "steps" is the easier style for the tiny model: the same 400-step warm
    start reaches 89 % held-out (greedy; 82.5 % sampled at T = 1) against 62.5 % for "rewrite",
    whose long copies leave more room for slips. The preset keeps "rewrite" for that room.
    """

    name: ClassVar[str] = "arith"
    marker: ClassVar[str] = "#"
    operands: tuple[int, int] = (4, 5)  # min, max numbers in the expression (a product counts 2)
    add_digits: tuple[int, int] = (1, 1)  # min, max digits of a +/- operand (digit count uniform)
    mul_digits: tuple[int, int] = (1, 1)  # digits of the left, right factor (quotient, divisor for '/')
    ops: str = "+-*"  # operator mix; add '/' for exact-division terms
    min_products: int = 1  # product/quotient terms every expression has (when '*' or '/' is in ops)
    p_product: float = 0.3  # chance that each further pair of operands becomes a product term
    allow_negative: bool = False  # False: resample when the running value goes below 0
    max_value: int | None = 9  # resample when any number in the worked solution exceeds it
    val_fraction: float = 0.1
    max_chars: int = 128
    format_reward: float = 0.0
    style: str = "rewrite"  # worked solution: "rewrite" (expression after each step) or "steps"

    def __post_init__(self) -> None:
        self.operands = tuple(self.operands)  # type: ignore[assignment]  # YAML gives lists
        self.add_digits = tuple(self.add_digits)  # type: ignore[assignment]
        self.mul_digits = tuple(self.mul_digits)  # type: ignore[assignment]
        self._check_common()
        lo, hi = self.operands
        if not 2 <= lo <= hi:
            raise ValueError(f"arith: operands must be (min, max) with 2 <= min <= max, got {self.operands}")
        if not 1 <= self.add_digits[0] <= self.add_digits[1]:
            raise ValueError(f"arith: add_digits must be (min, max) with 1 <= min <= max, got {self.add_digits}")
        if min(self.mul_digits) < 1 or len(self.mul_digits) != 2:
            raise ValueError(f"arith: mul_digits must be two digit counts >= 1, got {self.mul_digits}")
        if not self.ops or set(self.ops) - set("+-*/") or not set(self.ops) & set("+-"):
            raise ValueError(f"arith: ops must be drawn from '+-*/' and include '+' or '-', got {self.ops!r}")
        if self.style not in ("rewrite", "steps"):
            raise ValueError(f"arith: style must be 'rewrite' or 'steps', got {self.style!r}")
        if self.min_products < 0 or not 0.0 <= self.p_product <= 1.0:
            raise ValueError(f"arith: need min_products >= 0 and p_product in [0, 1], "
                             f"got {self.min_products}, {self.p_product}")
        smallest = 1
        for d in self.mul_digits:
            smallest *= 2 if d == 1 else 10 ** (d - 1)
        forced_product = self.min_products > 0 and bool(set(self.ops) & set("*/"))
        if self.max_value is not None and forced_product and smallest > self.max_value:
            raise ValueError(f"arith: no expression satisfies the knobs: every expression has a product of at "
                             f"least {smallest} (mul_digits={self.mul_digits}) > max_value={self.max_value}")

    def _term(self, rng: random.Random, kind: str) -> tuple[str, int, str | None, int]:
        """(text, value, worked step or None, largest number shown) for one term of the chain."""
        if kind == "n":
            v = _int_with_digits(rng, rng.randint(*self.add_digits), 1)
            return str(v), v, None, v
        for _ in range(1000):  # redraw the pair until the product fits (the caller rejects it otherwise)
            a = _int_with_digits(rng, self.mul_digits[0], 2)  # one-digit factors skip 0 and 1: no free steps
            b = _int_with_digits(rng, self.mul_digits[1], 2)
            if self.max_value is None or a * b <= self.max_value:
                break
        if kind == "*":
            return f"{a}*{b}", a * b, f"{a}*{b}={a * b}", a * b
        return f"{a * b}/{b}", a, f"{a * b}/{b}={a}", a * b  # exact by construction

    def _attempt(self, rng: random.Random, mults: list[str], adds: list[str]) -> Problem | None:
        """One draw; None when it breaks a constraint (aborting as soon as one fails saves most
        of the work). A +/- step that leaves the range takes the other sign if that fits."""
        cap = self.max_value
        left = rng.randint(*self.operands)
        kinds: list[str] = []
        if mults:
            for _ in range(min(self.min_products, left // 2)):
                kinds.append(rng.choice(mults))
                left -= 2
        while left > 0:
            if mults and left >= 2 and rng.random() < self.p_product:
                kinds.append(rng.choice(mults))
                left -= 2
            else:
                kinds.append("n")
                left -= 1
        rng.shuffle(kinds)
        terms = []
        for kind in kinds:
            terms.append(term := self._term(rng, kind))
            if cap is not None and term[3] > cap:
                return None

        steps = [step for _, _, step, _ in terms if step is not None]  # products first, in order
        expr, acc, signs = terms[0][0], terms[0][1], []
        for text, v, _, _ in terms[1:]:
            sign = rng.choice(adds)
            new = _apply(acc, sign, v)
            if not self._fits(new) and len(adds) == 2:  # the other sign may fit: flip rather than redraw
                sign = "-" if sign == "+" else "+"
                new = _apply(acc, sign, v)
            if not self._fits(new):
                return None
            steps.append(f"{acc}{sign}{v}={new}")
            expr += sign + text
            signs.append(sign)
            acc = new
        answer = str(acc)
        worked = ";".join(steps) if self.style == "steps" else "=".join(_rewrites(terms, signs))
        return Problem(prompt=expr + "=", answer=answer, solution=worked + self.marker + answer,
                       meta={"expr": expr, "n_steps": len(steps)})

    def _fits(self, value: int) -> bool:
        return (value >= 0 or self.allow_negative) and (self.max_value is None or abs(value) <= self.max_value)

    def make(self, rng: random.Random) -> Problem:
        """One problem (any split) from `rng`: rejection sampling under the constraints."""
        mults = [op for op in "*/" if op in self.ops]
        adds = [op for op in "+-" if op in self.ops]
        for _ in range(100_000):
            if (problem := self._attempt(rng, mults, adds)) is not None:
                return problem
        raise ValueError(f"arith: no expression satisfies the knobs (max_value={self.max_value}, "
                         f"operands={self.operands}, add_digits={self.add_digits}, mul_digits={self.mul_digits})")

    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:
        rng = random.Random(f"codraft.arith/{split}/{seed}")  # str seeds hash with SHA-512: stable
        while True:
            yield self.make(rng)


def _rewrites(terms: list[tuple[str, int, str | None, int]], signs: list[str]) -> list[str]:
    """The expression restated, then after each single operation: products/quotients left to
    right, then the +/- chain left to right, ending with the bare answer."""
    texts = [t[0] for t in terms]
    values = [t[1] for t in terms]
    out = [_join(texts, signs)]
    for i, (_, _, step, _) in enumerate(terms):  # each product/quotient term becomes its value
        if step is not None:
            texts[i] = str(values[i])
            out.append(_join(texts, signs))
    while len(values) > 1:  # then fold the leftmost +/- pair
        v = _apply(values[0], signs[0], values[1])
        values, texts, signs = [v] + values[2:], [str(v)] + texts[2:], signs[1:]
        out.append(_join(texts, signs))
    return out


def _apply(a: int, sign: str, b: int) -> int:
    return a + b if sign == "+" else a - b


def _join(texts: list[str], signs: list[str]) -> str:
    return texts[0] + "".join(s + t for s, t in zip(signs, texts[1:]))


# ---------------------------------------------------------------- gsm_symbolic


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


# ---------------------------------------------------------------- registry

TASKS: dict[str, type[Task]] = {"arith": ArithTask, "gsm_symbolic": GsmSymbolicTask}


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
