"""Tools as plain functions (``env.tools=FILE.py:f,g`` or ``module:f,g``): typed Python functions with
docstrings become the tools of a multi-turn run, no ``Environment`` subclass needed.

Each function's JSON schema comes from its type hints and its Google-style docstring, in the form
transformers' ``get_json_schema`` gives chat templates (``{"type": "function", "function": {"name",
"description", "parameters": {"type": "object", "properties", "required"}}}``). A chat model reads the
schemas through its template (``tools=``), or, where the template takes no tools, as the Hermes/Qwen tool
block in the system turn, and calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The tiny
policy writes ``[name a b]`` (the arguments in the parameters' order, the last one taking the rest of the
text) or ``[name {"a": 1}]``.

The model's arguments are checked against the hints (str, int, float, bool, list[...], dict[str, ...],
Optional/Union, Literal, Any): a wrong, missing or unknown argument is an ``error: ...`` observation the
policy reads, as is an exception the function raises (a plain function says "bad input" by raising). What
the function returns becomes the observation: text as is, anything else as JSON. A function that exits
its process, hangs or returns what JSON cannot write ends its episode (``codraft.envs.workers``): the
functions are your code, so ``env.isolation=auto`` runs them in worker processes, each importing your file
by its path.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Union

from codraft.envs.base import Environment
from codraft.errors import CodraftError
from codraft.tasks import Problem, Task

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SUPPORTED = "str, int, float, bool, list[...], dict[str, ...], Optional/Union, Literal, Any"
_SECTIONS = ("Args:", "Arguments:", "Returns:", "Raises:", "Yields:", "Examples:", "Example:")
_ARG = re.compile(r"(\w+)\s*(?:\([^()]*\))?\s*:\s*(.*)")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.I)


class ToolSpecError(CodraftError, ValueError):
    """``env.tools`` names a function that cannot be a tool (one line: which, and why)."""


class BadArguments(ValueError):
    """The model's arguments do not fit the function's hints (the policy reads why)."""


# ---------------------------------------------------------------- loading

def parse_spec(text: str) -> list[tuple[str, list[str]]]:
    """``a.py:f,g,mod:h`` -> [("a.py", ["f", "g"]), ("mod", ["h"])]: an item with a colon names a file or module
    and its first function; the items after it without one are more functions of it."""
    out: list[tuple[str, list[str]]] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if ":" in item:
            source, _, name = item.rpartition(":")
            out.append((source.strip(), [name.strip()]))
        elif out:
            out[-1][1].append(item)
        else:
            raise ToolSpecError(f"env.tools: {item!r} names no file or module: write FILE.py:{item} or module:{item}")
    return out


def absolute(text: str) -> str:
    """The spec with each file's path made absolute (a worker process may start in another folder)."""
    return ",".join(f"{str(Path(src).resolve()) if src.endswith('.py') else src}:{','.join(names)}"
                    for src, names in parse_spec(text))


def load_functions(text: str) -> dict[str, Callable]:
    """name -> function for each one ``env.tools`` names; refused in one line: a missing file, module or
    function, a duplicate name."""
    funcs: dict[str, Callable] = {}
    for source, names in parse_spec(text):
        module = _module(source)
        for name in names:
            fn = getattr(module, name, None)
            if not name.isidentifier() or not callable(fn):
                raise ToolSpecError(f"env.tools: {source} has no function {name!r}")
            if name in funcs:
                raise ToolSpecError(f"env.tools: two tools are named {name!r}: a tool's name must be unique")
            funcs[name] = fn
    if not funcs:
        raise ToolSpecError("env.tools names no function (write FILE.py:f,g or module:f,g)")
    return funcs


def _module(source: str) -> types.ModuleType:
    if not source.endswith(".py"):
        try:
            return importlib.import_module(source)
        except BaseException as e:  # noqa: BLE001 - your module failed to import
            raise ToolSpecError(f"env.tools: module {source!r} cannot be imported: {e!r}") from None
    path = Path(source).resolve()
    if not path.is_file():
        raise ToolSpecError(f"env.tools: no such file {source!r}")
    name = f"codraft_tools_{abs(hash(str(path)))}"
    if name in sys.modules:  # (imported once per process: a worker and the trainer each import it)
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses and pickling look a function's module up)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001
        del sys.modules[name]
        raise ToolSpecError(f"env.tools: {source} raised {e!r} on import") from None
    return module


# ---------------------------------------------------------------- schemas

def json_schema(fn: Callable) -> dict:
    """The function's tool schema, as transformers' ``get_json_schema`` writes it; refused in one line: a
    parameter without a type hint, a hint of an unsupported type, *args or **kwargs."""
    name = fn.__name__
    hints = typing.get_type_hints(fn)
    description, args_doc, returns_doc = parse_docstring(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSpecError(f"env.tools: {name}({p}): a tool takes named parameters, not *args or **kwargs")
        if p.name not in hints:
            raise ToolSpecError(f"env.tools: {name}: parameter {p.name!r} has no type hint (the model's arguments "
                                f"are checked against it; supported: {_SUPPORTED})")
        try:
            prop = hint_schema(hints[p.name])
        except TypeError as e:
            raise ToolSpecError(f"env.tools: {name}: parameter {p.name!r}: {e}") from None
        doc = args_doc.get(p.name)
        if doc is not None:
            choices = _CHOICES.search(doc)
            if choices:
                prop["enum"] = json.loads(choices.group(1))
                doc = doc[:choices.start()].strip()
            prop["description"] = doc
        properties[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:  # (the template may show it; a return hint JSON cannot say is left out)
        try:
            out["return"] = hint_schema(hints["return"])
            if returns_doc is not None:
                out["return"]["description"] = returns_doc
        except TypeError:
            pass
    return {"type": "function", "function": out}


def hint_schema(hint) -> dict:
    """A type hint's JSON schema; TypeError for one it cannot say."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        if hint in _SCALARS:
            return {"type": _SCALARS[hint]}
        if hint in (list, dict):
            return {"type": "array" if hint is list else "object"}
        raise TypeError(f"type hint {_name(hint)} is not supported ({_SUPPORTED})")
    if origin in (Union, types.UnionType):
        subs = [hint_schema(a) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subs):
            kinds = sorted({s["type"] for s in subs})
            out = {"type": kinds[0] if len(kinds) == 1 else kinds}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is Literal:
        if not all(type(a) in _SCALARS for a in args):
            raise TypeError(f"type hint {_name(hint)}: a Literal's values must be str, int, float, bool or None")
        kinds = list(dict.fromkeys(_SCALARS[type(a)] for a in args))
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": hint_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"type hint {_name(hint)}: a dict's keys must be str (JSON objects)")
        return {"type": "object", "additionalProperties": hint_schema(args[1])} if args else {"type": "object"}
    raise TypeError(f"type hint {_name(hint)} is not supported ({_SUPPORTED})")


def parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """A Google-style docstring -> (its description, {parameter: description} from ``Args:``, ``Returns:``)."""
    lines = doc.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() in _SECTIONS] + [len(lines)]
    description = "\n".join(lines[:starts[0]]).strip()
    args, returns = {}, None
    for a, b in zip(starts, starts[1:]):
        head, body = lines[a].strip(), [line for line in lines[a + 1:b] if line.strip()]
        if head == "Returns:":
            returns = " ".join(line.strip() for line in body) or None
        if head not in ("Args:", "Arguments:") or not body:
            continue
        indent = len(body[0]) - len(body[0].lstrip())
        name = None
        for line in body:
            m = _ARG.fullmatch(line.strip())
            if len(line) - len(line.lstrip()) <= indent and m:
                name = m.group(1)
                args[name] = m.group(2).strip()
            elif name is not None:  # a description's next line
                args[name] = f"{args[name]} {line.strip()}".strip()
    return description, args, returns


def _name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


# ---------------------------------------------------------------- calling

@dataclass
class FunctionTool:
    """One function as a tool: the model's argument text -> the observation text."""
    fn: Callable
    schema: dict

    def __post_init__(self):
        self.name = self.schema["function"]["name"]
        self.hints = typing.get_type_hints(self.fn)
        self.params = list(inspect.signature(self.fn).parameters.values())

    def __call__(self, args: str) -> str:
        try:
            kwargs = self.arguments(args)
        except BadArguments as e:
            return f"error: {self.name}: {e}"
        try:
            out = self.fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - a plain function says "bad input" by raising: the policy reads it
            return f"error: {self.name} raised {type(e).__name__}: {e}"
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False)  # (not JSON: a fault)

    def arguments(self, text: str) -> dict:
        """The call's keyword arguments, checked against the hints: from a JSON object, or (the tiny
        format) the text split over the parameters in order."""
        text = text.strip()
        if text.startswith("{"):
            try:
                given = json.loads(text)
            except json.JSONDecodeError as e:
                raise BadArguments(f"the arguments are not valid JSON ({e.msg})") from None
            if not isinstance(given, dict):
                raise BadArguments("the arguments must be a JSON object")
            from_text = False
        else:
            if text and not self.params:
                raise BadArguments("takes no arguments")
            parts = text.split(None, len(self.params) - 1) if text else []
            given, from_text = {p.name: v for p, v in zip(self.params, parts)}, True
        names = [p.name for p in self.params]
        unknown = [k for k in given if k not in names]
        if unknown:
            raise BadArguments(f"unknown argument {unknown[0]!r} (parameters: {', '.join(names) or 'none'})")
        missing = [p.name for p in self.params if p.default is p.empty and p.name not in given]
        if missing:
            raise BadArguments(f"missing argument {missing[0]!r}")
        return {k: coerce(v, self.hints[k], k, from_text) for k, v in given.items()}


def coerce(value, hint, name: str, from_text: bool = False):
    """``value`` as the hint wants it (text: parsed first); BadArguments naming the parameter otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if from_text and hint is not str and origin not in (Union, types.UnionType, Literal):
        if hint in (int, float, bool, type(None)) or origin in (list, dict) or hint in (list, dict):
            value = _parse_text(value)
    if origin in (Union, types.UnionType):
        for a in sorted(args, key=lambda a: a is not type(None)):  # (None first: "null" stays None)
            try:
                return coerce(value, a, name, from_text)
            except BadArguments:
                continue
        raise BadArguments(f"{name!r} must be {_kind(hint)}, got {_show(value)}")
    if origin is Literal:
        for a in args:
            if (str(a) == value if from_text and isinstance(value, str) else (a == value and type(a) is type(value))):
                return a
        raise BadArguments(f"{name!r} must be one of {', '.join(map(json.dumps, args))}, got {_show(value)}")
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in _SCALARS:
        if type(value) is hint:
            return value
        raise BadArguments(f"{name!r} must be {_kind(hint)}, got {_show(value)}")
    if hint is list or origin is list:
        if not isinstance(value, list):
            raise BadArguments(f"{name!r} must be {_kind(hint)}, got {_show(value)}")
        return [coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise BadArguments(f"{name!r} must be {_kind(hint)}, got {_show(value)}")
        return {k: coerce(v, args[1], f"{name}[{k!r}]") for k, v in value.items()} if args else value
    raise BadArguments(f"{name!r} has an unsupported hint")  # (refused at load: not reached)


def _parse_text(text: str):
    """The tiny format's argument text as a value: JSON (true, 3, [1, 2], null), or the text itself."""
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _kind(hint) -> str:
    s = hint_schema(hint)
    t = s.get("type", "any value")
    return {"string": "text", "integer": "an integer", "number": "a number", "boolean": "true or false",
            "array": "a list", "object": "an object", "null": "null"}.get(t, f"{t}") if isinstance(t, str) \
        else " or ".join(t)


def _show(value) -> str:
    return json.dumps(value[:40] + "..." if isinstance(value, str) and len(value) > 40 else value, default=repr)


# ---------------------------------------------------------------- the environment

class FunctionTools(Environment):
    """The run's task with your functions as its tools (``env.tools``). Reaches a worker process as
    (task, spec): rebuilt there by importing your file by its path."""
    name = "tools"

    def __init__(self, task: Task, spec: str, rewards=None):
        self.task, self.spec, self.rewards = task, absolute(spec), rewards
        funcs = load_functions(self.spec)
        self.schemas = [json_schema(f) for f in funcs.values()]
        self.tools = {n: FunctionTool(f, s) for (n, f), s in zip(funcs.items(), self.schemas)}

    def __reduce__(self):  # (the reward set stays in the trainer: rewards are scored there)
        return FunctionTools, (self.task, self.spec)

    def score(self, problems: list[Problem], texts: list[str], ids: list[list[int]]):
        """The run's reward functions (``rewards``: ``reward.funcs``, or the task's own), one episode at a
        time so that each failure is that episode's: its reward is the reward set's total, as in a single-turn
        run (a failing function scores 0 there, the others count; the error comes with it), and None where no
        function judged it (the episode is dropped from the step, ``codraft.rl.scoring``)."""
        if self.rewards is None:
            return super().score(problems, texts, ids)
        out = []
        for p, t, i in zip(problems, texts, ids):
            s = self.rewards.score([p], [t], [i])
            out.append((s.totals[0], RuntimeError("; ".join(s.errors)) if s.errors else None))
        return out

    def prompt_ids(self, tok, problem: Problem) -> list[int] | None:
        """A chat model's prompt with the tools' schemas: through the template where it takes ``tools``, else
        the Hermes tool block in the system turn. None (the run's own prompt) without a chat template, or
        with data.chat_template=none."""
        knobs = getattr(self.task, "knobs", {}) or {}
        if not getattr(tok, "chat_template", None) or knobs.get("chat_template") == "none":
            return None
        raw = getattr(problem, "raw_prompt", None)
        messages = [dict(m) for m in raw] if isinstance(raw, list) else \
            [{"role": "user", "content": raw if isinstance(raw, str) else problem.prompt}]
        system = knobs.get("system_prompt") or ""
        if system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        if getattr(tok, "renders_tools", False):
            return tok.encode(tok.chat_messages(messages, tools=self.schemas))
        block = tool_block(self.schemas)
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            default = getattr(tok, "default_system_prompt", None)
            messages.insert(0, {"role": "system", "content": f"{default}\n\n{block}" if default else block})
        return tok.encode(tok.chat_messages(messages))


def tool_block(schemas: list[dict]) -> str:
    """The tools as the Hermes/Qwen templates put them in the system turn, with the call format."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
