"""`codraft bench cp` end to end on a tiny row: the JSON has every row and field, with sane values
(no speed figures are asserted: they depend on the machine)."""
from __future__ import annotations

import json
import math

import torch

from codraft.cli import main


def test_bench_cp_writes_rows(tmp_path, capsys):
    """Run in a process whose heap holds freed small chunks, as a busy pytest worker's does: its forked ranks
    would reuse them without growing their RSS (a peak of 0) unless the bench returns them first."""
    junk = [torch.empty(2000) for _ in range(20_000)]  # 160 MB in 8 KB tensors, freed
    del junk
    out = tmp_path / "cp.json"
    main(["bench", "cp", "--lengths", "512", "--cp", "1,2", "--repeats", "1", "--warmup", "0",
          "--json", str(out)])
    assert "fwd+bwd s" in capsys.readouterr().out  # the table
    data = json.loads(out.read_text())
    assert data["machine"]["processor"] and data["machine"]["threads_per_rank"] == 1
    rows = {(r["method"], r["cp"], r["branch"]): r for r in data["rows"]}
    expected = [(m, 1, b) for m in ("single", "zigzag") for b in ("none", "eagle3", "dflash")]
    expected += [(m, 2, b) for m in ("zigzag", "usp", "ring", "allgather") for b in ("none", "eagle3", "dflash")]
    assert sorted(rows) == sorted(expected)
    assert not rows[("usp", 2, "dflash")]["supported"]  # USP cannot place branches: reported, not measured
    for key, r in rows.items():
        if not r["supported"]:
            continue
        assert r["length"] == 512 and r["torch"] and r["processor"]
        for field in ("latency_s", "fwd_s", "cpu_s", "peak_mem_bytes", "efficiency", "cpu_efficiency", "mem_vs_c1"):
            assert math.isfinite(r[field]) and r[field] > 0, (key, field, r[field])
        assert r["fwd_s"] <= r["latency_s"] * 1.0001
        assert len(r["rank_peak_mem_bytes"]) == r["cp"] and len(r["latency_runs_s"]) == 1
        if r["cp"] == 1:
            assert r["sent_bytes"] == 0
        else:
            assert r["sent_bytes"] > r["sent_fwd_bytes"] > 0
            if r["branch"] != "dflash":  # USP has no dflash row to compare with
                assert math.isfinite(r["speedup_vs_usp"]) and r["speedup_vs_usp"] > 0
        if r["base"] in ("zigzag", "ring"):  # the ring's forward sends exactly the formula's K/V bytes
            assert r["sent_fwd_bytes"] == r["formula_fwd_bytes"]
