"""Smoke test of `codraft.bench.e2e.run`, codraft's side only (the TRL peer is a benchmark, never a test)."""
import json

import pytest
import torch

from codraft.models import Transformer, save_pretrained
from codraft.tokenizer import CharTokenizer
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config


def _tiny_policy_dir(path):
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 32, 64, 2
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    save_pretrained(Transformer(cfg), path, extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return path


def test_e2e_codraft_side_only(tmp_path):
    from codraft.bench.e2e import run
    lines = []
    threads = torch.get_num_threads()
    try:
        out = run(steps=1, warmup=1, draft_kinds=("none", "ngram", "dflash"), threads=1, trl=False,
                  json_path=tmp_path / "e2e.json", max_new_tokens=4, prompts=2, group=2, gamma=2,
                  policy=str(_tiny_policy_dir(tmp_path / "policy")), task="arith", draft_init="random",
                  log=lines.append)
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data["settings"]["threads"] == 1 and data["settings"]["torch_threads"] == 1
    assert data["trl_skipped"] and "ratios" not in data
    assert set(data["sides"]) == {"codraft/none", "codraft/ngram", "codraft/dflash"}
    for name, side in data["sides"].items():
        assert len(side["steps"]) == 2, name
        m = side["median"]
        assert m["step_s"] > 0 and m["rollout_s"] > 0 and m["train_s"] > 0
        assert m["step_s"] >= m["rollout_s"]
        assert m["train_forward_s"] > 0 and m["optimizer_s"] > 0 and m["train_backward_s"] > 0
        assert m["draft_forward_s"] <= m["train_forward_s"]  # the draft's loss is part of the loss forward
        assert 1 <= m["completion_len"] <= m["completion_max"] <= 4
    assert data["sides"]["codraft/dflash"]["trainable_draft_params"] > 0
    assert data["sides"]["codraft/dflash"]["median"]["draft_forward_s"] > 0
    assert data["sides"]["codraft/ngram"]["median"]["acceptance_length"] >= 1.0
    assert "acceptance_length" not in data["sides"]["codraft/none"]["median"]
    text = "\n".join(lines)
    assert "TRL side skipped" in text and "codraft/dflash" in text and "step s" in text
    assert set(data["vs_none"]["sides"]) == {"codraft/ngram", "codraft/dflash"}
    assert "codraft/dflash vs codraft/none: step" in text
    assert out["sides"].keys() == data["sides"].keys()


def test_e2e_draft_kinds_are_the_registry_s():
    from codraft.bench.e2e import Settings
    from codraft.drafts import available_drafts
    every = ("none", *available_drafts())
    assert Settings(draft_kinds=list(every)).draft_kinds == every
    with pytest.raises(ValueError, match="unknown draft kind"):
        Settings(draft_kinds=("none", "bogus"))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        Settings(steps=0)


def test_each_draft_side_against_none_with_its_amdahl_bound():
    """Made-up medians (a 2-core Xeon run's, rounded): none 11 s a step with a 4 s rollout; the
    DSpark side 12 s with a 4 s rollout. Its step ratio is 11/12; a free rollout leaves 8 s, so at most
    11/8; the 1.3x target needs the step in 11/1.3 = 8.46 s, i.e. a 0.46 s rollout, 4/0.46 = 8.67x
    faster than none's; a side whose rest alone exceeds 8.46 s cannot reach it."""
    from codraft.bench.e2e import report

    def side(step, rollout, train):
        return {"median": {"step_s": step, "rollout_s": rollout, "train_s": train}}
    result = {"sides": {"codraft/none": side(11.0, 4.0, 6.5), "codraft/dspark": side(12.0, 4.0, 7.5),
                        "codraft/dflash": side(13.0, 3.0, 9.5), "trl": side(40.0, 20.0, 19.0)}}
    report.add_vs_none(result)
    got = result["vs_none"]
    assert got["target"] == report.TARGET_VS_NONE == 1.3 and set(got["sides"]) == {"codraft/dspark", "codraft/dflash"}
    d = got["sides"]["codraft/dspark"]
    assert d["step"] == pytest.approx(11 / 12) and d["rollout"] == 1.0 and d["train"] == pytest.approx(6.5 / 7.5)
    assert d["rollout_share"] == pytest.approx(4 / 11) and d["free_rollout"] == pytest.approx(11 / 8)
    assert d["rollout_needed"] == pytest.approx(4 / (11 / 1.3 - 8))
    assert got["sides"]["codraft/dflash"]["rollout_needed"] is None  # 10 s of rest > 8.46 s
    lines = []
    report.print_report({"settings": {"prompts": 2, "group": 8, "max_new_tokens": 128, "policy": "p", "threads": 2,
                                      "steps": 3, "warmup": 1}, **result}, lines.append)
    text = "\n".join(lines)
    assert "codraft/dspark vs codraft/none: step 0.92x" in text and "faster than none's by 8.67x" in text
    assert "codraft/dflash vs codraft/none" in text and "unreachable" in text
    no_none = {"sides": {"codraft/dspark": side(12.0, 4.0, 7.5)}}
    report.add_vs_none(no_none)
    assert "vs_none" not in no_none
