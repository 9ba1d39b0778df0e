"""`arith_haystack`: long `arith` contexts with distractors, for long-context (context-parallel) runs.

The prompt is ``context_chars`` characters of distractor lines, worked `arith` problems in the
very format the tiny policy writes (``3*3-8+2*2=9-8+2*2=9-8+4=1+4=5#5``), one per line,
followed by the actual `arith` question, ``expr=``, on the last line::

    ...3+2*4-1=3+8-1=11-1=10#10\\n7-2*3+4=7-6+4=1+4=5#5\\n2*4+1-3=

The context is the tail of the joined distractor lines cut to exactly ``context_chars``
characters (its first line is usually partial), so a prompt has ``context_chars +
len(question)`` characters. ``layout="both"`` also states the question first, ``question\\n``
before the context (then the prompt is ``len(question) + 1`` longer). ``context_chars=0`` gives
`arith` itself: the same prompts, in the same order, the same splits.

Everything else is `arith`'s: the questions come from its generator with its knobs (its
stream, seeded per (split, seed)), the answer, the worked solution (the SFT target) and the
reward depend on the question only. The distractors are a fixed function of the question
(seeded by its text), so a question always comes with the same context.

Splits never overlap: a prompt's split is `arith`'s split of its question (the last line), so a
question is in one split whatever its context. Distractors are always `train` questions other
than the prompt's own, so no worked `val` solution appears in any prompt.

Characters: digits, ``+-*/=#`` and ``\\n``, all in the tiny character tokenizer's alphabet.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from codraft.tasks.arith import ArithTask
from codraft.tasks.base import Problem

MAX_CONTEXT_CHARS = 32768
LAYOUTS = ("end", "both")
SEPARATOR = "\n"


@dataclass
class ArithHaystackTask(ArithTask):
    """`arith` questions at the end of ``context_chars`` characters of worked distractor problems.

    Knobs: `arith`'s (they shape the questions and the distractors alike), plus
    ``context_chars`` (0..32768, the distractor characters before the question) and ``layout``
    ("end": the question only at the end; "both": also once before the context).
    ``make(rng)`` gives a bare question (as `arith`'s); ``embed(question)`` puts it in its context.
    """

    name: ClassVar[str] = "arith_haystack"
    context_chars: int = 4096
    layout: str = "end"

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.context_chars
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= MAX_CONTEXT_CHARS:
            raise ValueError(f"arith_haystack: context_chars must be an int in [0, {MAX_CONTEXT_CHARS}] "
                             f"(distractor characters before the question), got {c!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"arith_haystack: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @staticmethod
    def question_of(prompt: str) -> str:
        """The `arith` question of a prompt: its last line."""
        return prompt[prompt.rfind(SEPARATOR) + 1:]

    def split_of(self, prompt: str) -> str:
        return super().split_of(self.question_of(prompt))

    def context(self, question: str) -> str:
        """``context_chars`` characters of distractor lines, each ending with the separator; a fixed
        function of the question text (and the knobs)."""
        n = self.context_chars
        if n == 0:
            return ""
        rng = random.Random(f"codraft.arith_haystack/{question}")  # str seeds hash with SHA-512: stable
        lines: list[str] = []
        size = 0
        while size < n:
            p = self.make(rng)
            if p.prompt == question or super().split_of(p.prompt) != "train":
                continue
            lines.append(p.prompt + self.format_completion(p) + SEPARATOR)
            size += len(lines[-1])
        return "".join(lines)[-n:]

    def embed(self, question: Problem) -> Problem:
        """The haystack problem of a bare `arith` question: same answer and solution, long prompt."""
        q = question.prompt
        head = q + SEPARATOR if self.layout == "both" and self.context_chars else ""
        return Problem(prompt=head + self.context(q) + q, answer=question.answer, solution=question.solution,
                       meta={**question.meta, "question": q, "context_chars": self.context_chars})

    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:
        # arith's stream; questions of the other split are dropped before their context is built
        for q in super()._candidates(split, seed):
            if super().split_of(q.prompt) == split:
                yield self.embed(q)
