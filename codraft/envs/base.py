"""The environment contract: ``Environment`` (a task's problems, its tools, the episode's reward) and the
tool-call formats the policy writes (``ToolFormat``).

An episode starts from a task prompt; the policy writes until it ends its turn. A turn that ends with
a tool call (``name args`` inside the format's tags) is answered by that tool's result as an
observation; a turn without one ends the episode, which is scored by ``reward`` on the policy's own
text (never the observations': a tool cannot hand the policy its answer marker). A task is a
single-turn environment without tools.

Formats: the tiny character policy writes ``[calc 17+23*4-8]`` (the turn stops at ``]``) and reads
``{101}``; a chat model writes ``<tool_call>calc 17+23*4-8</tool_call>`` or the Hermes/Qwen JSON
``<tool_call>{"name": "calc", "arguments": {...}}</tool_call>`` (the arguments reach the tool as JSON text),
ends its turn with EOS, and reads the result as a ``tool`` turn of its chat template (ChatML).
"""
from __future__ import annotations

import abc
import json
import math
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

    def prompt_ids(self, tok, problem: Problem) -> list[int] | None:
        """The ids an episode of ``problem`` starts from where the environment renders its own prompt (its tools'
        schemas in it); None: the run's prompt."""
        return None

    def score(self, problems: list[Problem], texts: list[str], ids: list[list[int]]
              ) -> list[tuple[float | None, Exception | None]]:
        """Each episode's (reward, error) from the policy's own text and tokens: ``reward`` one by one, a reward
        that raises or is not finite scoring 0 with its error. A reward of None: no reward judged the episode
        (it is dropped from the step)."""
        return [checked_reward(lambda p=p, t=t: self.reward(p, t)) for p, t in zip(problems, texts)]


def checked_reward(fn: Callable[[], float]) -> tuple[float, Exception | None]:
    """(the reward, None), or (0, why) when it raises or is not a finite number."""
    try:
        r = float(fn())
    except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted, as a task's
        return 0.0, e
    return (r, None) if math.isfinite(r) else (0.0, ValueError(f"non-finite reward {r}"))


def _call(body: str) -> ToolCall | None:
    """A call's text: ``name args``, or the Hermes/Qwen JSON ``{"name": ..., "arguments": {...}}`` (its arguments
    as JSON text)."""
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    m = re.fullmatch(r"(\w+)\s*(.*)", body, re.S)
    return ToolCall(*m.groups()) if m else None


class ToolFormat:
    """How the policy writes a tool call and reads its result."""
    stop_text: str = ""  # text that ends a turn besides EOS ("" = EOS alone)

    def __init__(self, open_tag: str, close_tag: str, render: Callable[[str], str]):
        self.call = re.compile(re.escape(open_tag) + r"\s*(.*?)\s*" + re.escape(close_tag), re.S)
        self.render = render

    def parse(self, turn: str) -> ToolCall | None:
        """The turn's last tool call, or None (the turn ends the episode)."""
        calls = [c for c in map(_call, self.call.findall(turn)) if c is not None]
        return calls[-1] if calls else None

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
