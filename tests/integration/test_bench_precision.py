"""`codraft bench precision` on a small saved policy: both parts, each side's ratio against the fp32 side of
the same rounds, the draft's share against the no-draft side of the same policy precision, the fp32
policy matching its own rollout's logprobs and bf16 products moving the losses only a little."""
import json
import statistics

import pytest

from codraft.bench.gemv import paired_ratio
from codraft.cli import main


def test_precision_sides_compare_with_fp32_of_the_same_rounds(tiny_policy_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CODRAFT_CACHE", str(tmp_path / "cache"))  # (the feature cache is built there)
    out = tmp_path / "precision.json"
    main(["bench", "precision", "--model", str(tiny_policy_dir), "--drafts", "dspark", "--offline-drafts", "dflash",
          "--draft-init", "random", "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--sequences", "6",
          "--rounds", "2", "--warmup", "1", "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())

    sides = data["grpo"]["sides"]
    assert sorted(sides) == sorted(["policy fp32", "policy fp32 + dspark fp32", "policy fp32 + dspark bf16",
                                    "policy bf16", "policy bf16 + dspark fp32", "policy bf16 + dspark bf16"])
    base = sides["policy fp32"]["seconds"]
    for name, s in sides.items():
        assert len(s["seconds"]) == 2 and s["median_s"] == statistics.median(s["seconds"])
        assert s["vs_fp32"] == pytest.approx(paired_ratio(base, s["seconds"]))
        if " + " in name:
            own = sides[name.split(" + ")[0]]
            assert s["draft_s"] == pytest.approx(s["median_s"] - own["median_s"])
    assert sides["policy fp32"]["vs_fp32"] == 1.0
    assert abs(sides["policy fp32"]["rollout_kl"]) < 1e-4  # the trainer's fp32 forward is the rollout's model
    assert sides["policy bf16"]["rollout_kl"] < 0.05
    assert sides["policy bf16"]["loss"] == pytest.approx(sides["policy fp32"]["loss"], abs=0.05)

    (offline,) = data["offline"]
    assert offline["kind"] == "dflash" and offline["sequences"] == 6
    fp32, bf16 = offline["sides"]["fp32"], offline["sides"]["bf16"]
    assert fp32["vs_fp32"] == 1.0 and bf16["vs_fp32"] == pytest.approx(paired_ratio(fp32["seconds"], bf16["seconds"]))
    assert len(fp32["losses"]) == len(bf16["losses"]) == 4  # the last round's steps: the same batches both sides
    for a, b in zip(fp32["losses"], bf16["losses"]):
        assert b == pytest.approx(a, rel=2e-2)
