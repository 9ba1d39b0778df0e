"""`arith`: synthetic multi-step integer arithmetic for the tiny character-level preset."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Iterator

from codraft.tasks.base import Problem, Task


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
