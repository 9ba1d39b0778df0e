"""`codraft bench tap` end to end at a tiny size: the JSON has every method's row with sane
fields (no speed figures are asserted: they depend on the machine)."""
from __future__ import annotations

import json
import math

from codraft.cli import main


def test_bench_tap_writes_rows(tmp_path, capsys):
    out = tmp_path / "tap.json"
    main(["bench", "tap", "--sizes", "16x8", "--producers", "2", "--taps", "3", "--microbatches", "3",
          "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert "latency ms" in capsys.readouterr().out  # the table
    data = json.loads(out.read_text())
    assert data["bench"] == "tap" and data["machine"]["processor"]
    rows = {r["method"]: r for r in data["rows"]}
    assert sorted(rows) == ["p2p", "relay", "shm", "staging"]
    for m, r in rows.items():
        assert (r["tokens"], r["hidden"], r["taps"], r["producers"], r["processes"]) == (16, 8, 3, 2, 3)
        assert r["bytes_per_microbatch"] == 3 * 16 * 8 * 4 and r["microbatches"] == 3
        for field in ("latency_s", "bandwidth_gbps", "speedup_vs_staging"):
            assert math.isfinite(r[field]) and r[field] > 0, (m, field, r[field])
        assert len(r["latency_runs_s"]) == 1 and len(r["stream_runs_s"]) == 1
    assert rows["staging"]["speedup_vs_staging"] == 1.0


def test_bench_tap_step_writes_rows(tmp_path, capsys):
    out = tmp_path / "tap_step.json"
    main(["bench", "tap", "--step", "--shape", "2x64", "--groups", "2", "--microbatches", "2", "--repeats", "1",
          "--warmup", "0", "--methods", "none,shm,relay", "--json", str(out)])
    assert "vs none" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["bench"] == "tap-step" and data["machine"]["processor"]
    rows = {r["method"]: r for r in data["rows"]}
    assert sorted(rows) == ["none", "relay", "shm"]
    for m, r in rows.items():
        assert (r["stages"], r["microbatches"], r["layers"], r["hidden"]) == (2, 2, 2, 64)
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0 and len(r["runs_s"]) == 1
    assert rows["none"]["vs_none"] == 1.0 and rows["shm"]["vs_shm"] == 1.0
