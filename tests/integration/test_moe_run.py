"""A mixture-of-experts policy end to end: GRPO with a co-trained draft, routing replay and the routers'
load-balancing loss, a resume, and `codraft export-draft` of the run's draft for the MoE target."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from codraft.config import ConfigError
from codraft.export.write import export_draft
from codraft.models import Transformer, save_pretrained
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config
from codraft.rl.trainer import Trainer, train
from codraft.tokenizer import CharTokenizer
from tiny_runs import run_config


@pytest.fixture
def moe_policy_dir(tmp_path):
    tok = CharTokenizer()
    cfg = dataclasses.replace(tiny_model_config(tok, moe=True), hidden_size=64, head_dim=16, moe_intermediate_size=32,
                              intermediate_size=64, num_hidden_layers=4)
    torch.manual_seed(0)
    save_pretrained(Transformer(cfg), tmp_path / "policy",
                    extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return tmp_path / "policy"


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_moe_run_with_replay_resumes_and_exports(moe_policy_dir, tmp_path, varied_reward, kind):
    run = tmp_path / "run"
    extra = ("grpo.routing_replay=true", "grpo.router_aux_coef=0.01") + (("draft.taps=0,1,2",) if kind == "eagle3"
                                                                         else ())
    train(run_config(moe_policy_dir, run, 2, kind=kind, extra=extra), progress=False)
    train(run_config(moe_policy_dir, run, 3, kind=kind, extra=extra), resume=str(run), progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the trainer's weights are the rollout's and its routes are replayed: no mismatch
        assert r["policy/router_aux_loss"] > 0 and abs(r["mismatch_kl"]) < 1e-5
    e = export_draft(run / "step_3", tmp_path / "export", mask_token_id=None if kind == "eagle3" else 0)
    assert (e.path / "config.json").is_file() and (e.path / "model.safetensors").is_file()


def test_moe_keys_are_refused_for_a_dense_policy(tiny_policy_dir, tmp_path):
    with pytest.raises(ConfigError, match="config key 'grpo.routing_replay' is for a mixture-of-experts policy: .* "
                                          "is dense \\(architecture LlamaForCausalLM\\), got True"):
        Trainer(run_config(tiny_policy_dir, tmp_path / "r", 1, extra=("grpo.routing_replay=true",)), progress=False)
