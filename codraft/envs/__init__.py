"""Multi-turn environments: the policy calls tools and reads their results within one episode.

- ``calculator`` — any task with a ``calc`` tool (``[calc 17+23*4-8]`` -> ``{101}``);
- ``lookup`` — the ``lookup`` task's table behind ``dept`` and ``budget`` tools: two calls per episode.

Your functions as tools, no subclass (``env.tools=FILE.py:f,g``): ``FunctionTools`` (``codraft.envs.functions``:
JSON schemas from the type hints and docstrings, arguments checked against the hints).

Your own: subclass ``Environment`` with a ``task`` (problems and the final reward) and ``tools`` (name
-> a function of the argument text returning text), and register it in ``ENVS``. ``play`` runs a batch
of episodes against one (``EpisodeBatch`` answers, ``codraft.rollout.turns.run_episodes`` drives the
engine); its tool calls run on threads or in worker processes (``codraft.envs.workers``: env.isolation).
"""
from __future__ import annotations

from codraft.envs.base import Environment, EpisodeEnd, ToolCall, ToolFormat
from codraft.envs.calculator import Calculator, calc
from codraft.envs.episodes import Episode, EpisodeBatch, play, prompt_ids
from codraft.envs.functions import FunctionTools, ToolSpecError, json_schema
from codraft.envs.lookup import Lookup
from codraft.tasks import LookupTask, Task

ENVS = {"calculator": Calculator, "lookup": Lookup}


def make_env(name: str, task: Task, tools: str = "", rewards=None) -> Environment:
    """The environment ``name`` over ``task``, or with ``tools`` (``env.tools``, name none) your functions as its
    tools, scored by ``rewards`` (the run's reward set) where given; unknown names are refused listing the
    known ones."""
    if tools:
        if name != "none":
            raise ValueError(f"env.tools needs env.name=none (the tools are your functions), got env.name={name!r}")
        return FunctionTools(task, tools, rewards)
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVS))}")
    if name == "lookup" and not isinstance(task, LookupTask):
        raise ValueError(f"env.name=lookup reads the lookup task's table: set task.name=lookup (got {task.name!r})")
    return ENVS[name](task)


__all__ = ["ENVS", "Calculator", "Environment", "Episode", "EpisodeBatch", "EpisodeEnd", "FunctionTools", "Lookup",
           "ToolCall", "ToolFormat", "ToolSpecError", "calc", "json_schema", "make_env", "play", "prompt_ids"]
