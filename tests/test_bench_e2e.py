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
