"""``lookup``: a multi-step lookup that needs at least two tool calls per episode (the Workplace Assistant
pattern at toy scale), over the ``lookup`` task's table: the policy finds an employee's department
(``[dept ann]`` -> ``{d2}``), then its budget (``[budget d2]`` -> ``{7}``), then answers (``7+37=44#44``).
"""
from __future__ import annotations

from dataclasses import dataclass

from codraft.envs.base import Environment
from codraft.tasks.lookup import LookupTask


@dataclass
class Lookup(Environment):
    name = "lookup"
    task: LookupTask

    def __post_init__(self):
        table = self.task
        self.tools = {"dept": lambda who: table.dept_of.get(who, "error: no such employee"),
                      "budget": lambda d: str(table.budget_of.get(d, "error: no such department"))}

