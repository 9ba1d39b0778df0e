"""`codraft bench tp` on the tiny policy: every part's rows with their fields, finite; tp=2 holding about half of
tp=1's parameter bytes per rank and dp=2 × tp=2 about a quarter; tp=2's gradient norm tp=1's (the same batch),
also with sequence parallelism, which keeps fewer activations for the backward than tp=2 alone, and that fewer
than tp=1; steps that took time. No speed is asserted. A policy whose heads do not split is refused before any
process."""
import json
import math

import pytest

from codraft.cli import main
from codraft.policy.resolve import policy_config
from codraft.rl import memory


def test_bench_tp_rows(tmp_path):
    out = tmp_path / "tp.json"
    main(["bench", "tp", "--tokens", "32", "--repeats", "1", "--steps", "1", "--prompts", "2", "--json", str(out),
          "rollout.group_size=2", "rollout.max_new_tokens=8", "draft.init=random"])
    data = json.loads(out.read_text())
    assert data["bench"] == "tp" and data["settings"]["threads"] == 1 and data["settings"]["tp"] == 2
    rows = {(r["part"], r["layout"]): r for r in data["rows"]}
    assert sorted(rows) == sorted([("memory", "tp=1"), ("memory", "tp=2"), ("memory", "tp=2 sp"),
                                   ("memory", "dp=2 tp=2 fsdp"), ("step", "tp=1"), ("step", "tp=2")])
    for r in data["rows"]:
        assert r["processor"] == data["machine"]["processor"] and r["processor"]
        assert r["date"] == data["machine"]["date"] and r["cpu_flags"] == data["machine"]["cpu_flags"]
        numbers = [v for v in r.values() if isinstance(v, float)]
        assert numbers and all(math.isfinite(v) for v in numbers), r

    one, tp2, sp, both = (rows["memory", k] for k in ("tp=1", "tp=2", "tp=2 sp", "dp=2 tp=2 fsdp"))
    for k in ("param", "grad", "optim", "total", "act"):
        assert one[f"{k}_bytes"] > 0 and one[f"{k}_ratio"] == 1.0
    assert 0.45 <= tp2["param_ratio"] <= 0.65  # the products split, the norms replicated
    assert 0.2 <= both["param_ratio"] <= 0.35 and len(both["rank_param_bytes"]) == 4
    assert one["param_bytes"] == 4 * one["parameters"] == 4 * tp2["parameters"]  # fp32; DTensors count whole
    assert tp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)  # one batch, split products
    assert sp["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4) and sp["param_bytes"] == tp2["param_bytes"]
    # the activations kept for the backward: the products' split by tp, the residual stream's too by sp
    assert sp["act_bytes"] < tp2["act_bytes"] < one["act_bytes"]
    # and the memory check's estimate of a layer's activations splits as measured (embedding, logits aside)
    m = policy_config("tiny-sft")[0]
    a = memory._layer_floats(m)
    assert tp2["act_ratio"] == pytest.approx(memory._layer_floats(m, 2) / a, abs=0.08)
    assert sp["act_ratio"] == pytest.approx(memory._layer_floats(m, 2, sequence=True) / a, abs=0.08)
    for r in (one, tp2, sp, both):
        assert r["fwd_bwd_s"] > 0 and len(r["fwd_bwd_runs_s"]) == 1

    s1, s2 = rows["step", "tp=1"], rows["step", "tp=2"]
    assert s1["prompts_per_step"] == s2["prompts_per_step"] == 2  # strong scaling: the same batch
    for s in (s1, s2):
        assert s["time_step"] > 0 and s["time_train"] > 0 and s["time_rollout"] > 0 and s["steps"] == 1
        assert s["speedup"] == pytest.approx(s1["time_step"] / s["time_step"])
    assert s2["time_refit"] > 0 and s1["time_refit"] is None  # tp=1 decodes from the trainer's own weights


def test_bench_tp_refuses_a_policy_that_does_not_split():
    with pytest.raises(SystemExit, match=r"--model tiny \(tiny-sft\) does not split over --tp 3: .*heads=4"):
        main(["bench", "tp", "--parts", "memory", "--tp", "3"])
