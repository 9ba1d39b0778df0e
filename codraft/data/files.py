"""Reading a data file into rows: JSONL, JSON, Parquet, CSV or a ``save_to_disk`` folder, with Hugging Face
``datasets``, local files only (the hub is never asked: ``HF_DATASETS_OFFLINE``).

A file that cannot be read is one ``DataError`` line naming it and, where the reader knows it, the row
(JSON lines are re-read one by one to find the first bad one: ``datasets`` reports a byte offset at best).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from codraft.errors import CodraftError, MissingPackageError

# By extension; a folder is a save_to_disk dataset (a DatasetDict: its "train" split).
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(CodraftError, ValueError):
    """A data file that cannot train: unreadable, missing a column, empty, or a prompt past the context."""


def read_rows(path: str) -> list[dict]:
    """Every row of the file or folder at ``path``, as plain Python dicts (columns -> values)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: no such file or folder")
    if p.is_dir():
        rows = _read_folder(p)
    else:
        builder = BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unknown data format {p.suffix or '(no extension)'!r}; give a .jsonl, .json, "
                            f".parquet or .csv file, or a save_to_disk folder")
        rows = _read_file(p, builder)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ModuleNotFoundError:
        raise MissingPackageError("data files are read with Hugging Face datasets: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()  # its own failures come back as one DataError line
    return datasets


def _read_file(p: Path, builder: str) -> list[dict]:
    datasets = _datasets()
    if builder == "json":
        _check_json(p)  # names the bad row, which datasets' own error does not
    try:
        ds = datasets.load_dataset(builder, data_files=str(p), split="train", keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's, said in one line
        raise DataError(f"{p}: cannot be read as {p.suffix[1:]}: {_first_line(e)}") from None
    return ds.to_list()


def _read_folder(p: Path) -> list[dict]:
    datasets = _datasets()
    try:
        ds = datasets.load_from_disk(str(p), keep_in_memory=True)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{p}: not a save_to_disk dataset folder: {_first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):  # a folder of splits: its train split
        if "train" not in ds:
            raise DataError(f"{p}: a dataset folder of splits {', '.join(ds)} has no 'train' split; give the split's "
                            f"own folder ({p}/SPLIT)")
        ds = ds["train"]
    return ds.to_list()


def _check_json(p: Path) -> None:
    """A .jsonl (or a .json that is JSON lines) whose line does not parse, or is not an object: row named."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if p.suffix.lower() == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # perhaps JSON lines: checked line by line below
        if isinstance(whole, (list, dict)):
            if isinstance(whole, list):
                bad = next((i for i, r in enumerate(whole) if not isinstance(r, dict)), None)
                if bad is not None:
                    raise DataError(f"{p}: row {bad + 1}: not an object of columns, got {type(whole[bad]).__name__}")
            return
    row = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row += 1
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: row {row} (line {number}): not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(value, dict):
            raise DataError(f"{p}: row {row} (line {number}): not an object of columns, got {type(value).__name__}")
    if row == 0:
        raise DataError(f"{p}: no rows")


def _first_line(e: Exception) -> str:
    cause = e.__cause__ or e.__context__
    text = str(cause if cause is not None and str(cause) else e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]
