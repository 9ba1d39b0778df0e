"""`codraft bench draft-length` on a small saved policy with an untrained DSpark draft: every round of the
gamma=auto rollouts lands in one (rows, g) cell, the cells add up to what the rollouts' own stats report,
and each prediction is the cost model's own figure for that cell."""
import json

import pytest

from codraft.cli import main
from codraft.rollout import CostModel


def test_draft_length_cells_add_up_and_predict_from_the_cost_model(tiny_policy_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))  # (the calibration is written there)
    out = tmp_path / "dl.json"
    main(["bench", "draft-length", "--model", str(tiny_policy_dir), "--draft", "dspark", "--draft-init", "random",
          "--batch", "3", "--prompts", "5", "--repeats", "1", "--max-new-tokens", "12", "--threads", "1",
          "--json", str(out)])
    data = json.loads(out.read_text())
    cells, totals = data["cells"], data["totals"]
    c = data["cost_model"]
    cost = CostModel(tuple(c["rows"]), tuple(map(tuple, c["target_s"])), tuple(map(tuple, c["draft_s"])))
    assert cost.rows[-1] >= 3 and cells
    assert sum(x["rounds"] for x in cells) == totals["rounds"] > 0
    assert sum(x["target_s"] for x in cells) == pytest.approx(totals["verify_s"], rel=1e-9)
    assert sum(x["draft_s"] for x in cells) == pytest.approx(totals["step_draft_s"], rel=1e-9)
    by_g = [sum(x["rounds"] for x in cells if x["g"] == g) for g in range(data["settings"]["max_gamma"] + 1)]
    assert by_g == totals["gamma_chosen"]
    for x in cells:
        assert 1 <= x["rows"] <= 3 and 0 <= x["g"] <= data["settings"]["max_gamma"]
        assert x["target_pred_s"] == pytest.approx(x["rounds"] * cost.target(x["rows"], x["g"] + 1))
        assert x["draft_pred_s"] == pytest.approx(x["rounds"] * cost.draft(x["rows"], x["g"]))
        assert x["target_ratio"] == pytest.approx(x["target_s"] / x["target_pred_s"])
    for s in data["spread"]:
        assert s["spread"] == pytest.approx(s["highest"]["ratio"] / s["lowest"]["ratio"]) and s["spread"] >= 1
