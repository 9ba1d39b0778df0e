"""``FileTask``: a task whose problems are the rows of your data files (``data.train``, ``data.val``), so the
trainer takes them through the same ``Task`` interface as the built-in generators: ``stream`` (the training
prompts, position = prompts used, which checkpoints save), ``sample`` (the held-out prompts), ``epoch``.

Each row becomes a ``DataProblem``: its prompt (``data.prompt_key``: text or a list of chat messages) rendered
to token ids once, at load (with the tokenizer's chat template under ``data.chat_template=auto`` when it has
one, and ``data.system_prompt``), and every other column kept for the reward functions (``meta``). The answer
the built-in rewards compare with is the first of the columns ``answer``, ``ground_truth``,
``reward_model.ground_truth`` (verl's layout) and ``solution`` that the row has.

Order: each pass over the training rows (an epoch) is a permutation of them drawn from (seed, epoch)
(``data.shuffle=false``: file order), so the k-th training prompt is a fixed function of (seed, k) and a
resumed run sees the prompts an uninterrupted one does.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from codraft.data.files import DataError, read_rows
from codraft.tasks.base import Problem, Task

ANSWER_COLUMNS = ("answer", "ground_truth", "reward_model.ground_truth", "solution")


@dataclass
class DataProblem(Problem):
    raw_prompt: Any = None  # the prompt column as the file has it: text, or chat messages
    source: str = ""        # the file it comes from
    row: int = 0            # its row there (1-based)


class FileTask(Task):
    """Problems from data files (see the module doc); build with ``load_file_task``."""

    name = "data"
    marker = ""

    def __init__(self, train: list[DataProblem], val: list[DataProblem], knobs: dict, shuffle: bool):
        self.train, self.val, self._knobs, self.shuffle = train, val, knobs, shuffle
        self.val_fraction, self.max_chars, self.format_reward = knobs["val_fraction"], 1, 0.0

    @property
    def knobs(self) -> dict[str, Any]:
        return dict(self._knobs)

    @property
    def problem_knobs(self) -> dict[str, Any]:
        """What decides the problems (an offline draft's cache key): the keys and the files' contents."""
        return {**self._knobs, "content": _fingerprint([self._knobs["train"], self._knobs["val"]])}

    def _candidates(self, split: str, seed: int) -> Iterator[Problem]:  # (stream is overridden)
        raise NotImplementedError

    def order(self, seed: int, epoch: int) -> list[int]:
        """The training rows' order in pass ``epoch``: a permutation from (seed, epoch), or file order."""
        idx = list(range(len(self.train)))
        if self.shuffle:
            random.Random(f"codraft.data/{seed}/{epoch}").shuffle(idx)  # str seeds: stable across processes
        return idx

    def stream(self, split: str, seed: int = 0) -> Iterator[Problem]:
        """Training rows pass after pass (each in its seeded order); held-out rows in file order, cycled."""
        if split == "val":
            return itertools.cycle(self.val)
        if split != "train":
            raise ValueError(f"split must be one of ('train', 'val'), got {split!r}")
        return (self.train[i] for epoch in itertools.count() for i in self.order(seed, epoch))

    def sample(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """``n`` training prompts from the stream (rows repeat past an epoch); the first ``n`` held-out rows
        (all of them when there are fewer: a held-out row is never counted twice)."""
        if split == "val":
            return list(self.val[:n])
        return list(itertools.islice(self.stream(split, seed), n))

    def epoch(self, used: int) -> float | None:
        return used / len(self.train)

    def _reward(self, problem: Problem, completion) -> float:
        raise DataError("a data file has no reward of its own: name its reward functions in reward.funcs")


def load_file_task(d, tok, *, context: int, max_new_tokens: int, seed: int) -> FileTask:
    """The ``FileTask`` of the ``data`` config section ``d``: files read, split, prompts rendered and checked
    against the policy's ``context`` (prompt + ``max_new_tokens``)."""
    rows = read_rows(d.train)
    _check_column(d.train, rows, d.prompt_key)
    if d.val:
        val_rows = read_rows(d.val)
        _check_column(d.val, val_rows, d.prompt_key)
        train = [(d.train, i, r) for i, r in enumerate(rows)]
        val = [(d.val, i, r) for i, r in enumerate(val_rows)]
    else:  # a seeded held-out fraction, at least one row, leaving at least one
        held = max(1, round(len(rows) * d.val_fraction))
        if held >= len(rows):
            raise DataError(f"{d.train}: {len(rows)} row(s) leave none to train on after holding out "
                            f"data.val_fraction={d.val_fraction:g} (at least one row) for validation; add rows or "
                            f"give data.val")
        out = set(random.Random(f"codraft.data.val/{seed}").sample(range(len(rows)), held))
        train = [(d.train, i, r) for i, r in enumerate(rows) if i not in out]
        val = [(d.train, i, r) for i, r in enumerate(rows) if i in out]
    render = _Renderer(tok, d, context, max_new_tokens)
    knobs = {"train": d.train, "val": d.val, "prompt_key": d.prompt_key, "chat_template": d.chat_template,
             "system_prompt": d.system_prompt, "val_fraction": d.val_fraction, "shuffle": d.shuffle}
    return FileTask([render(*x) for x in train], [render(*x) for x in val], knobs, d.shuffle)


def _check_column(path: str, rows: list[dict], key: str) -> None:
    if key not in rows[0]:
        raise DataError(f"{path}: no column {key!r} (data.prompt_key); its columns: {', '.join(rows[0])}")


class _Renderer:
    """A row -> its ``DataProblem``, the prompt rendered to ids and checked."""

    def __init__(self, tok, d, context: int, max_new_tokens: int):
        self.tok, self.d, self.context, self.max_new = tok, d, context, max_new_tokens
        self.chat = d.chat_template == "auto" and getattr(tok, "is_chat", False)  # (the char tokenizer has none)

    def __call__(self, path: str, i: int, row: dict) -> DataProblem:
        key = self.d.prompt_key
        where = f"{path}: row {i + 1}: column {key!r}"
        value = row[key]
        messages = _messages(value, where)
        text = "\n".join(m["content"] for m in messages)
        system = self.d.system_prompt
        if self.chat:
            turns = ([{"role": "system", "content": system}] if system else []) + messages
            ids = self.tok.prompt_ids(text) if turns == [{"role": "user", "content": text}] else \
                self.tok.encode(self.tok.chat_messages(turns))  # (a lone user turn: the built-in tasks' own ids)
        else:
            text = f"{system}\n{text}" if system else text
            ids = self._plain(text)
        if len(ids) + self.max_new > self.context:
            raise DataError(f"{where}: the prompt is {len(ids)} tokens; with rollout.max_new_tokens={self.max_new} "
                            f"it passes the policy's context of {self.context} tokens (shorten it, or lower "
                            f"rollout.max_new_tokens)")
        meta = {k: v for k, v in row.items() if k != key}
        return DataProblem(prompt=text, answer=_answer(meta), solution="", meta=meta, prompt_ids=ids,
                           raw_prompt=value, source=path, row=i + 1)

    def _plain(self, text: str) -> list[int]:
        """The text's ids without a chat template (a BOS first where the tokenizer adds one)."""
        if not getattr(self.tok, "is_chat", False):
            return self.tok.prompt_ids(text)
        bos = [self.tok.bos_id] if getattr(self.tok, "add_bos", False) and self.tok.bos_id is not None else []
        return bos + self.tok.encode(text)


def _messages(value, where: str) -> list[dict]:
    """The prompt as chat messages: text is one user turn; a list must hold {role, content} texts."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: the prompt is empty")
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value:
        for j, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: message {j + 1} is not {{'role': text, 'content': text}}: {m!r}"[:300])
        return [{"role": m["role"], "content": m["content"]} for m in value]
    what = "null" if value is None else "an empty list" if value == [] else type(value).__name__
    raise DataError(f"{where}: the prompt must be text or a list of chat messages ({{role, content}}), got {what}")


def _answer(columns: dict) -> str:
    """The first answer column the row has (``ANSWER_COLUMNS``), as text; "" when none."""
    for name in ANSWER_COLUMNS:
        value = columns
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return str(value)
    return ""


def _fingerprint(paths) -> str:
    h = hashlib.sha256()
    for path in filter(None, paths):
        p = Path(path)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(f.read_bytes())
    return h.hexdigest()[:12]
