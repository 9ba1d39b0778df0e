"""`lookup`: questions over an in-memory table of employees, departments and budgets, answered with
tools (``codraft.envs.lookup``): ``ann+37=`` asks for the budget of ann's department plus 3. The worked
solution is the tool-using episode, ``[dept ann]{d2}[budget d2]{7}7+37=44#44`` (an SFT target)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Iterator

from codraft.tasks.base import Problem, Task

NAMES = ("ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal", "ivy", "joe", "kim", "lee", "max", "ned", "oli",
         "pam", "quy", "ray", "sam", "tom", "uma", "val", "wes", "xia", "yan", "zed")


@dataclass
class LookupTask(Task):
    """The questions and their answers; the worked solution is the tool-using episode (an SFT target)."""
    name: ClassVar[str] = "lookup"
    marker: ClassVar[str] = "#"
    employees: int = 24
    departments: int = 4
    table_seed: int = 0
    val_fraction: float = 0.1
    max_chars: int = 128
    format_reward: float = 0.0

    def __post_init__(self):
        self._check_common()
        if not 1 <= self.departments <= 9 or not 1 <= self.employees <= len(NAMES):
            raise ValueError(f"lookup: need 1 <= departments <= 9 and 1 <= employees <= {len(NAMES)}, got "
                             f"{self.departments}, {self.employees}")
        rng = random.Random(self.table_seed)
        depts = [f"d{i + 1}" for i in range(self.departments)]
        # the table: attributes, not knobs (a function of the knobs)
        self.dept_of = {n: rng.choice(depts) for n in NAMES[:self.employees]}
        self.budget_of = {d: rng.randint(1, 9) for d in depts}

    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:
        rng = random.Random(f"lookup-{split}-{seed}")
        while True:
            who, extra = rng.choice(sorted(self.dept_of)), rng.randint(0, 99)
            d = self.dept_of[who]
            b = self.budget_of[d]
            yield Problem(f"{who}+{extra}=", str(b + extra),
                          f"[dept {who}]{{{d}}}[budget {d}]{{{b}}}{b}+{extra}={b + extra}#{b + extra}",
                          meta={"who": who})
