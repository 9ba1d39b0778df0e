"""The environment contract: ``Environment`` (a task's problems, its tools, the episode's reward) and the
tool-call formats the policy writes (``ToolFormat``).

An episode starts from a task prompt; the policy writes until it ends its turn. A turn that ends with
a tool call (``name args`` inside the format's tags) is answered by that tool's result as an
observation; a turn without one ends the episode, which is scored by ``reward`` on the policy's own
text (never the observations': a tool cannot hand the policy its answer marker). A task is a
single-turn environment without tools.

Formats: the tiny character policy writes ``[calc 17+23*4-8]`` (the turn stops at ``]``) and reads
``{101}``; a chat model writes ``<tool_call>calc 17+23*4-8</tool_call>`` and ends its turn with EOS, and
reads the result as a ``tool`` turn of its chat template (ChatML).
"""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from codraft.tasks import Problem, Task


class EpisodeEnd(Exception):
    """Ends one episode early with a reason (an unknown tool, a broken environment); never the run."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: str


class Environment(abc.ABC):
    """A multi-turn environment: ``task`` (problems, the final reward) and ``tools`` (name -> a function of
    the argument text returning the result text). Override ``start`` for per-episode state and ``call``
    for tools that read it."""

    name: ClassVar[str]
    task: Task
    tools: dict[str, Callable[[str], str]]

    def start(self, problem: Problem) -> Any:
        """Per-episode state, handed to ``call`` (default: none)."""
        return None

    def call(self, problem: Problem, state: Any, call: ToolCall) -> str:
        if call.name not in self.tools:
            raise EpisodeEnd(f"unknown tool {call.name!r} (this environment has {', '.join(sorted(self.tools))})")
        return self.tools[call.name](call.args)

    def reward(self, problem: Problem, text: str) -> float:
        """The episode's reward from the policy's own text (all its turns)."""
        return self.task.reward(problem, text)


class ToolFormat:
    """How the policy writes a tool call and reads its result."""
    stop_text: str = ""  # text that ends a turn besides EOS ("" = EOS alone)

    def __init__(self, open_tag: str, close_tag: str, render: Callable[[str], str]):
        self.call = re.compile(re.escape(open_tag) + r"\s*(\w+)\s*(.*?)\s*" + re.escape(close_tag), re.S)
        self.render = render

    def parse(self, turn: str) -> ToolCall | None:
        """The turn's last tool call, or None (the turn ends the episode)."""
        calls = self.call.findall(turn)
        return ToolCall(*calls[-1]) if calls else None

    @classmethod
    def for_tokenizer(cls, tok) -> "ToolFormat":
        if getattr(tok, "chat_template", None):  # ChatML: the result as a tool turn, then the assistant's
            fmt = cls("<tool_call>", "</tool_call>",
                      lambda r: f"\n<|im_start|>tool\n{r}<|im_end|>\n<|im_start|>assistant\n")
        else:
            fmt = cls("[", "]", lambda r: "{" + r + "}")
            fmt.stop_text = "]"
        return fmt

    def stop_ids(self, tok) -> list[int]:
        """Token ids that end a turn besides EOS: the closing tag's, where it is one token."""
        if not self.stop_text:
            return []
        ids = tok.encode(self.stop_text)
        if len(ids) != 1:
            raise ValueError(f"the tool format's closing tag {self.stop_text!r} is {len(ids)} tokens, not one")
        return ids
