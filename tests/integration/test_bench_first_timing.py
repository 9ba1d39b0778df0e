"""`codraft bench first-timing` on a small saved policy: every table a decode step looks up is timed from
nothing in a private folder, while the tables cached in $CODRAFT_CACHE and this process's stay as they were."""
import json

import torch

from codraft.bench import first_timing
from codraft.cli import main
from codraft.kernels import dispatch
from codraft.policy import load_policy
from codraft.rollout.weights import RolloutWeights


def test_first_timing_times_every_table_privately(tiny_policy_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))
    timed = []

    def fake_measure(candidates, grid=dispatch.GRID, timer=None):  # the candidates are built, not timed
        timed.append(sorted(candidates))
        first = sorted(candidates)[0]
        return {m: {name: (1e-6 if name == first else 2e-6) for name in candidates} for m in grid}
    monkeypatch.setattr(dispatch, "measure", fake_measure)
    monkeypatch.setattr(dispatch, "_others_cores", lambda before, after: 0.0)  # a busy host: cached all the same
    monkeypatch.setattr(dispatch, "TABLES", {})  # (none remembered from earlier tests: they are looked up below)
    model = load_policy(str(tiny_policy_dir))[0].eval()
    decoder = RolloutWeights(model, torch.float32).policy
    expected = first_timing.lookups(decoder)
    with torch.inference_mode():
        for _, _, look_up in expected:  # this process's tables and the cached ones, as a run leaves them
            look_up()
    cached = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "cache" / "dispatch").iterdir())
    assert sum(name.startswith(("product-", "layer-")) for name, _ in cached) == len(expected)  # (+ the GEMV tuning)
    ours = dict(dispatch.TABLES)
    timed.clear()

    out = tmp_path / "first.json"
    main(["bench", "first-timing", "--model", str(tiny_policy_dir), "--threads", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["tables"]
    assert len(timed) == len(rows) == len(expected)  # each timed again, none read from a cache
    assert [(r["op"], r["key"]) for r in rows] == [(op, what) for op, what, _ in expected]
    assert sum(r["op"] == "layer" for r in rows) <= 1 and sum(r["op"] == "product" for r in rows) >= 2
    for r in rows:
        assert r["seconds"] > 0 and r["peak_rss_mb_after"] >= r["peak_rss_mb_before"] > 0
        los, his = [lo for lo, _, _ in r["ranges"]], [hi for _, hi, _ in r["ranges"]]
        assert los[0] == 1 and his[-1] == dispatch.GRID[-1] and los[1:] == [h + 1 for h in his[:-1]]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "cache" / "dispatch").iterdir()) == cached
    assert dispatch.TABLES == ours  # this process's tables put back
