"""Per-step metrics: one JSON line per step in `metrics.jsonl`, mirrored to TensorBoard.

TensorBoard is optional (the `tensorboard` package); without it the JSON log is complete
on its own and `codraft plot` draws from it. On resume the log is cut back to the
checkpointed step, so a resumed run's metrics line up with an uninterrupted one.
"""
from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [l for l in self.path.read_text().splitlines() if l and json.loads(l)["step"] <= resume_step]
            self.path.write_text("".join(l + "\n" for l in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")
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

    def close(self):
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a codraft run folder")
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
