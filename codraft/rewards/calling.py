"""Loading a reward function by name and calling it the way its signature asks, in the trainer's process or a
worker's (``codraft.rewards.worker``): the same code both places.

Two conventions, told apart by the parameters:
- TRL: ``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, once per batch; every
  column of the data (other than the prompt) arrives as a keyword of the same name, a list over the batch
  (a function without ``**kwargs`` gets the ones it names). May be ``async``.
- verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ...}``,
  once per sample.
Whatever a function returns is checked here: a batch of the wrong length, or a value that is not a finite
number (or None), is that function's error on those samples, never the trainer's.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


@dataclass
class Batch:
    """One call's samples, as the functions see them (plain values: it may cross to a worker process)."""
    prompts: list            # the prompt column as the data has it (text, or chat messages)
    completions: list        # text, or [{"role": "assistant", "content": text}] for chat prompts (TRL's way)
    texts: list[str]         # the completions' text
    completion_ids: list[list[int]]
    columns: list[dict]      # each sample's other columns
    answers: list[str]       # the answer column the built-in rewards compare with

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class Result:
    values: list             # float or None (None: the function does not judge this sample)
    errors: list             # None, or why that sample's value is missing (it then scores 0)


class RewardLoadError(Exception):
    """A reward function that cannot be loaded (the caller turns it into one config line)."""


# FILE.py modules loaded in this process, by resolved path (with the file's modification time, so an edited
# file is imported afresh): ``f.py:a,f.py:b`` imports f.py once, and its functions share its module state, as
# those of a module imported by name do.
_FILE_MODULES: dict[str, tuple[int, Any]] = {}


def load(spec: str) -> Callable:
    """The function ``FILE.py:NAME`` or ``module:NAME``."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise RewardLoadError(f"{target}: no such file")
        resolved, mtime = str(path.resolve()), path.stat().st_mtime_ns
        mtime_then, module = _FILE_MODULES.get(resolved, (None, None))
        if module is None or mtime_then != mtime:
            module_name = f"codraft_reward_{abs(hash(resolved))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # (dataclasses and pickling look their module up)
            try:
                loader.loader.exec_module(module)
            except BaseException as e:  # noqa: BLE001 - the user's module failed to import
                sys.modules.pop(module_name, None)
                raise RewardLoadError(f"{target} raised {e!r} on import") from None
            _FILE_MODULES[resolved] = (mtime, module)
    else:
        try:
            module = importlib.import_module(target)
        except BaseException as e:  # noqa: BLE001
            raise RewardLoadError(f"module {target!r} cannot be imported: {e!r}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardLoadError(f"{target} has no function {name!r}")
    return fn


def style_of(fn: Callable, spec: str) -> str:
    """"verl" or "trl", from the parameters; anything else cannot be called either way."""
    params = inspect.signature(fn).parameters
    if all(p in params for p in VERL_PARAMS):
        return "verl"
    if "completions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "trl"
    raise RewardLoadError(f"{spec}: parameters ({', '.join(params)}) match neither TRL's f(prompts, completions, "
                          f"completion_ids, **columns) nor verl's compute_score(data_source, solution_str, "
                          f"ground_truth, extra_info=None)")


def call(fn: Callable, style: str, batch: Batch) -> Result:
    """Call ``fn`` on the batch its way; every failure is a per-sample error in the result."""
    n = len(batch)
    if style == "verl":
        out = Result([None] * n, [None] * n)
        for i in range(n):
            try:
                c = batch.columns[i]
                got = _run(fn, data_source=c.get("data_source"), solution_str=batch.texts[i],
                           ground_truth=ground_truth(c, batch.answers[i]),
                           extra_info=c.get("extra_info"))
                out.values[i] = number(got["score"] if isinstance(got, dict) else got)
            except Exception as e:  # noqa: BLE001 - the user's code: this sample's error
                out.errors[i] = repr(e)
        return out
    try:
        got = _run(fn, **_keywords(fn, batch))
        got = list(got)
        if len(got) != n:
            raise ValueError(f"returned {len(got)} values for {n} completions")
    except Exception as e:  # noqa: BLE001
        return Result([None] * n, [repr(e)] * n)
    out = Result([None] * n, [None] * n)
    for i, v in enumerate(got):
        try:
            out.values[i] = number(v)
        except (TypeError, ValueError) as e:
            out.errors[i] = repr(e)
    return out


def ground_truth(columns: dict, answer: str):
    """verl's ``ground_truth`` for a row, as verl passes it (``reward_model["ground_truth"]``, raw: a list or a
    number stays one), else the row's ``ground_truth``, ``answer`` or ``solution`` column as written, else
    ``answer`` (the built-in rewards' answer text)."""
    rm = columns.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return rm["ground_truth"]
    return next((columns[k] for k in ("ground_truth", "answer", "solution") if columns.get(k) is not None), answer)


def number(v: Any) -> float | None:
    """A finite float, or None; anything else is a ValueError/TypeError."""
    if v is None:
        return None
    if isinstance(v, str):
        raise TypeError(f"returned text {v[:40]!r}, not a number")
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"non-finite reward {x}")
    return x


def _keywords(fn: Callable, batch: Batch) -> dict:
    """TRL's keywords: prompts, completions, completion_ids and every column as a list over the batch."""
    names = dict.fromkeys(k for c in batch.columns for k in c)
    kw = {k: [c.get(k) for c in batch.columns] for k in names}
    kw.update(prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids)
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kw
    return {k: v for k, v in kw.items() if k in params}


def _run(fn: Callable, **kw):
    got = fn(**kw)
    if inspect.isawaitable(got):  # an async function (TRL allows them)
        got = asyncio.run(_await(got))
    return got


async def _await(x):
    return await x
