"""Reading a data file into rows: JSONL, JSON, Parquet, CSV or a ``save_to_disk`` folder, local files only
(the hub is never asked: ``HF_DATASETS_OFFLINE``).

Every value is the one the file holds, of the type it is written as:
- JSON and JSON lines are parsed with Python's ``json`` (each row the object written; a column a row lacks
  is None there). Not with ``datasets``: Arrow gives a column one type, so answers mixing ``42`` and ``1.5``
  would all become floats (``42`` read back as ``42.0``).
- CSV is read with ``datasets`` with every column as text, exactly as written (``007`` stays ``"007"``, an
  empty cell is ``""``, ``NA`` is ``"NA"``): a CSV has no types, and inferring them turned ``007`` into 7, or
  into ``7.0`` in a column with an empty cell.
- Parquet and ``save_to_disk`` folders are read with ``datasets``, with the types they were saved with.

A file that cannot be read is one ``DataError`` line naming it and, where the reader knows it, the row.
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
    if builder == "json":
        return _read_json(p)
    datasets = _datasets()
    kwargs = {}
    if builder == "csv":  # every column as text, as written (an empty cell is "", not a missing value)
        kwargs = {"features": datasets.Features({c: datasets.Value("string") for c in _csv_columns(p)}),
                  "keep_default_na": False}
    try:
        ds = datasets.load_dataset(builder, data_files=str(p), split="train", keep_in_memory=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's, said in one line
        raise DataError(f"{p}: cannot be read as {p.suffix[1:]}: {_first_line(e)}") from None
    return ds.to_list()


def _csv_columns(p: Path) -> list[str]:
    """The CSV's column names as the reader (pandas) names them."""
    try:
        import pandas
        return [str(c) for c in pandas.read_csv(p, nrows=0).columns]
    except Exception as e:  # noqa: BLE001
        raise DataError(f"{p}: cannot be read as csv: {_first_line(e)}") from None


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


def _read_json(p: Path) -> list[dict]:
    """The rows of a .jsonl, or a .json (a list of row objects, one object, or JSON lines), as written; a line
    that does not parse, or a row that is not an object, is named. Every row has every column (None where a
    row lacks it), as a table has."""
    try:
        text = p.read_text(encoding="utf-8-sig")  # (a leading byte order mark is not the first row's)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = None
    if p.suffix.lower() == ".json" and text.lstrip()[:1] in ("[", "{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # perhaps JSON lines: read line by line below
        if isinstance(whole, list):
            bad = next((i for i, r in enumerate(whole) if not isinstance(r, dict)), None)
            if bad is not None:
                raise DataError(f"{p}: row {bad + 1}: not an object of columns, got {type(whole[bad]).__name__}")
            rows = whole
        elif isinstance(whole, dict):
            rows = [whole]
    if rows is None:
        rows = []
        # Lines end at "\n" only: str.splitlines() also splits at U+2028, U+2029, \x85, \x0b, \x0c and \x1c-\x1e,
        # which JSON allows unescaped inside a string.
        for number, line in enumerate(text.split("\n"), 1):
            line = line.removesuffix("\r")
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}: row {len(rows) + 1} (line {number}): not JSON: {e.msg} at column "
                                f"{e.colno}") from None
            if not isinstance(value, dict):
                raise DataError(f"{p}: row {len(rows) + 1} (line {number}): not an object of columns, got "
                                f"{type(value).__name__}")
            rows.append(value)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in columns} for r in rows]


def _first_line(e: Exception) -> str:
    cause = e.__cause__ or e.__context__
    text = str(cause if cause is not None and str(cause) else e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]
