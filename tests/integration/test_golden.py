"""Golden metrics: a short fixed-seed run of the tiny preset against a committed metrics file.

Catches silent changes in the training math (the GRPO loss, the draft loss, advantages, the
engine's sampling) that every unit test might miss because each checks one piece against its own
oracle. The run is the user's default job (`codraft train`, tiny-sft, offline DFlash draft,
co-trained), shortened to a few steps. Tolerances leave room for the last float digits, which
differ between CPUs (kernels and their dispatch are chosen per machine); a change to the math
moves these metrics by far more.

After an intended change of the math, regenerate the file and commit it with the change:

    CODRAFT_GOLDEN_UPDATE=1 python -m pytest tests/integration/test_golden.py
"""
import json
import math
import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden") / "tiny_metrics.json"
OVERRIDES = ["steps=4", "log.val_every=2", "log.speedup_every=0", "log.checkpoint_every=0", "seed=1618"]
# metric -> (absolute, relative) tolerance, checked as |got - want| <= abs + rel * |want|
TOLERANCES = {
    "reward_mean": (0.02, 0.0),
    "completion_len": (0.5, 0.02),
    "policy/num_tokens": (2.0, 0.02),
    "policy/loss": (2e-3, 0.05),
    "policy/entropy": (2e-3, 0.02),
    "policy/grad_norm": (1e-3, 0.05),
    "acceptance_length": (0.05, 0.02),
    "draft/loss": (2e-3, 0.02),
    "draft/acc": (5e-3, 0.01),
    "draft/grad_norm": (1e-2, 0.05),
    "val_accuracy": (0.02, 0.0),
}


def _run(tmp_path) -> list[dict]:
    from codraft.config import load_config
    from codraft.rl.trainer import Trainer
    cfg = load_config(None, [*OVERRIDES, f"run_dir={tmp_path / 'run'}"])
    Trainer(cfg, progress=False).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: float(r[k]) for k in TOLERANCES if k in r}} for r in rows]


def test_the_tiny_preset_matches_its_golden_metrics(tmp_path):
    rows = _run(tmp_path)
    if os.environ.get("CODRAFT_GOLDEN_UPDATE"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"overrides": OVERRIDES, "rows": rows}, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES, "the golden file was written for other settings: regenerate it"
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    off = []
    for got, want in zip(rows, golden["rows"]):
        assert set(got) == set(want), f"step {got['step']}: metrics {sorted(set(got) ^ set(want))} appeared/vanished"
        for k, w in want.items():
            if k == "step":
                continue
            a, r = TOLERANCES[k]
            if not math.isclose(got[k], w, rel_tol=r, abs_tol=a):
                off.append(f"step {got['step']} {k}: {got[k]:.6g}, golden {w:.6g}")
    assert not off, "metrics moved from tests/integration/golden/tiny_metrics.json:\n" + "\n".join(off)
