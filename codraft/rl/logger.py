"""Per-step metrics: one JSON line per step in `metrics.jsonl`, mirrored to TensorBoard.

TensorBoard is optional (the `tensorboard` package); without it the JSON log is complete
on its own and `codraft plot` draws from it. On resume the log is cut back to the
checkpointed step, so a resumed run's metrics line up with an uninterrupted one.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from codraft.atomic import atomic_write_text


class MetricsLogger:
    """Appends the rows of one run. A fresh run starts the file (it never replaces one: the trainer
    refuses a folder that holds a run); a resume first cuts it back to ``resume_step`` (a line cut
    short by a crash goes too), rewriting it atomically, so no row of the kept steps can be lost."""

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        if resume_step is not None:
            for path in (self.path, self.samples_path):
                atomic_write_text(path, "".join(l + "\n" for l in _rows_upto(path, resume_step)))
        self._file = open(self.path, "a" if resume_step is not None else "x")
        self._samples = None  # samples.jsonl, opened at the first samples
        self._resumed = resume_step is not None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=(resume_step or 0) + 1)
        except ImportError:
            self._tb = None

    def log(self, step: int, metrics: dict):
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def samples(self, step: int, rows: list[dict]):
        """Completions with their rewards: one JSON line each in samples.jsonl, a table in TensorBoard's text tab."""
        if self._samples is None:
            self._samples = open(self.samples_path, "a" if self._resumed else "x")
        self._samples.write("".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
        self._samples.flush()
        if self._tb is not None:
            cell = lambda text: str(text).replace("|", "\\|").replace("\n", "<br>")  # noqa: E731 - markdown table cell
            table = ["| prompt | completion | reward | advantage |", "|---|---|---|---|"]
            table += [f"| {cell(r['prompt'])} | {cell(r['completion'])} | {r['reward']:.3g} | {r['advantage']:.3g} |"
                      for r in rows]
            self._tb.add_text("samples", "\n".join(table), step)

    def close(self):
        self._file.close()
        if self._samples is not None:
            self._samples.close()
        if self._tb is not None:
            self._tb.close()


def _rows_upto(path: Path, step: int) -> list[str]:
    """The lines of ``path`` whose row is at or before ``step`` (unreadable lines dropped)."""
    kept = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    return kept


def _plain(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (none for an empty file); a missing file, or a line that
    is not a JSON object with an int "step", is a one-line error naming the file and the line. A last
    line without its newline that does not parse is skipped: a write cut short by a crash."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a codraft run folder")
    try:
        lines = path.read_text().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
    partial = lines.pop()  # "" when the file ends with its newline
    rows = [_metrics_row(path, i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if partial.strip():
        try:
            rows.append(_metrics_row(path, len(lines) + 1, partial))
        except ValueError:
            pass
    return rows


def _metrics_row(path: Path, i: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
        raise ValueError(f"{path}: line {i} is not a metrics row (a JSON object with an int \"step\")")
    return row
