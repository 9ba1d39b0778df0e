"""`codraft bench dp` on the tiny preset: every part's rows with their fields, FSDP holding about half of
dp=1's bytes per rank and replicate all of them, at dp=2 × pp=2 a quarter and (ddp) all weights but half
the gradients and moments, a refit and steps that took time. No speed is asserted."""
import json

import pytest

from codraft.cli import main

MEMORY = ("param", "grad", "optim", "total")


def test_bench_dp_rows(tmp_path):
    out = tmp_path / "dp.json"
    main(["bench", "dp", "--model", "tiny", "--repeats", "2", "--steps", "1", "--prompts", "2", "--json", str(out),
          "rollout.group_size=2", "rollout.max_new_tokens=8", "draft.init=random"])
    data = json.loads(out.read_text())
    assert data["bench"] == "dp" and data["settings"]["threads"] == 1
    rows = {(r["part"], r["layout"]): r for r in data["rows"]}
    assert sorted(rows) == sorted([("memory", "dp=1"), ("memory", "dp=2 fsdp"), ("memory", "dp=2 ddp"),
                                   ("refit", "dp=1"), ("refit", "dp=2 fsdp"), ("refit", "dp=2 ddp"),
                                   ("step", "dp=1"), ("step", "dp=2 fsdp"),
                                   ("memory", "dp=2 pp=2 fsdp"), ("memory", "dp=2 pp=2 ddp"),
                                   ("refit", "dp=2 pp=2 fsdp"), ("refit", "dp=2 pp=2 ddp")])
    for r in data["rows"]:
        assert r["processor"] == data["machine"]["processor"] and r["processor"]
        assert r["date"] == data["machine"]["date"]

    one, fsdp, ddp = (rows["memory", k] for k in ("dp=1", "dp=2 fsdp", "dp=2 ddp"))
    for k in MEMORY:
        assert one[f"{k}_bytes"] > 0 and one[f"{k}_ratio"] == 1.0
        assert 0.4 <= fsdp[f"{k}_ratio"] <= 0.6, k
        assert fsdp[f"{k}_bytes"] == pytest.approx(fsdp[f"{k}_ratio"] * one[f"{k}_bytes"])
        assert ddp[f"{k}_bytes"] == one[f"{k}_bytes"] and ddp[f"{k}_ratio"] == 1.0, k
    assert one["param_bytes"] == 4 * one["parameters"]  # fp32, every parameter once
    assert len(fsdp["rank_param_bytes"]) == 2 and sum(fsdp["rank_param_bytes"]) == one["param_bytes"]
    assert one["optim_bytes"] >= 2 * one["param_bytes"]  # AdamW's two moments (and its step counters)

    # dp=2 × pp=2: fsdp holds a quarter (a stage's half; the tied embedding is on both stages), ddp every
    # weight but a stage's gradients and moments only
    staged, whole = rows["memory", "dp=2 pp=2 fsdp"], rows["memory", "dp=2 pp=2 ddp"]
    assert len(staged["rank_param_bytes"]) == 4 and (staged["dp"], staged["pp"]) == (2, 2)
    for k in MEMORY:
        assert 0.2 <= staged[f"{k}_ratio"] <= 0.35, k
    assert whole["param_ratio"] == 1.0 and all(0.4 <= whole[f"{k}_ratio"] <= 0.65 for k in ("grad", "optim"))
    for layout in ("dp=2 pp=2 fsdp", "dp=2 pp=2 ddp"):
        assert rows["refit", layout]["refit_s"] > 0 and rows["refit", layout]["copy_bytes"] >= one["param_bytes"]

    refit = rows["refit", "dp=2 fsdp"]
    assert refit["refit_s"] > 0 and len(refit["refit_runs_s"]) == 2 and refit["gb_per_s"] > 0
    assert refit["copy_bytes"] >= one["param_bytes"]  # the engine's whole copy (a buffer or two besides)

    s1, s2 = rows["step", "dp=1"], rows["step", "dp=2 fsdp"]
    assert (s1["prompts_per_step"], s2["prompts_per_step"]) == (2, 4)  # weak scaling: the batch doubled
    for s in (s1, s2):
        assert s["time_step"] > 0 and s["time_train"] > 0 and s["time_rollout"] > 0 and s["steps"] == 1
        assert s["efficiency"] == pytest.approx(s1["time_step"] / s["time_step"])
    assert s2["time_refit"] > 0 and s1["time_refit"] is None  # dp=1 decodes from the trainer's own weights
