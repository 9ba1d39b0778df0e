"""A tiny policy, its rollouts and short runs of the trainer: the setup that unit, distributed and
integration tests share (the fixtures built on it are in conftest.py)."""
import dataclasses
import json

import pytest
import torch

from codraft.config import load_config
from codraft.models import Transformer, save_pretrained
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config
from codraft.rollout import Engine
from codraft.tokenizer import CharTokenizer
from codraft.train.checkpoint import load_policy_from


def tiny_policy(seed=0, layers=4, hidden=64):
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = hidden, 128, layers
    cfg.head_dim = hidden // cfg.num_attention_heads
    torch.manual_seed(seed)
    return Transformer(cfg), tok


def save_tiny_policy(path, layers=2, hidden=32, moe=False, tied=True):
    """A random tiny policy saved as the trainer's policy.init reads it (HF folder + its char tokenizer);
    ``moe``: as a Qwen3-MoE decoder (4 experts, top-2, the first layer dense); ``tied=False``: its own LM head."""
    policy, tok = tiny_policy(layers=layers, hidden=hidden)
    if not tied:
        torch.manual_seed(0)
        policy = Transformer(dataclasses.replace(policy.config, tie_word_embeddings=False))
    if moe:
        torch.manual_seed(0)
        policy = Transformer(dataclasses.replace(policy.config, architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0]))
    save_pretrained(policy, path, extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return path


def sample_rollouts(policy, tok, n=4, max_new=12, seed=0):
    prompts = [tok.prompt_ids(s) for s in ["12+3=", "7*8-1=", "5+5=", "99-9*2="][:n]]
    out = Engine(policy).generate(prompts, max_new, temperature=1.0, seed=seed, eos_id=tok.eos_id)
    return prompts, out


def run_config(policy_dir, run_dir, steps, kind="dflash", mode="cotrain", extra=()):
    return load_config(None, [f"policy.init={policy_dir}", f"steps={steps}", f"run_dir={run_dir}",
                              "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=10",
                              "log.val_size=4", "log.val_every=2", "log.speedup_every=2", "log.checkpoint_every=2",
                              "log.keep_last=3", f"draft.kind={kind}", f"draft.mode={mode}", "draft.init=random",
                              "draft.gamma=3", "grpo.lr=1e-3", "grpo.kl_coef=0.01", *extra])


_TIMING = ("time", "tokens_per_s", "rollout_speedup")


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(_TIMING) and "time" not in k} for r in rows]


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def checkpoint_weights(ckpt_dir):
    s = {f"policy.{k}": v for k, v in load_policy_from(ckpt_dir).state_dict().items()}
    s.update({f"draft.{k}": v for k, v in torch.load(ckpt_dir / "draft.pt", weights_only=True).items()})
    return s


def alternating_reward(self, problem, completion) -> float:
    """ArithTask's reward replaced (the ``varied_reward`` fixture; spawned ranks set it themselves): it
    differs within groups, as the random tiny policy never solves arith, so advantages and updates are non-zero."""
    return float(len(completion) % 2)


# what a resumed run must repeat of an uninterrupted one (timings aside)
STEP_KEYS = ("reward_mean", "completion_len", "policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm",
             "acceptance_length")


def step_rows(run) -> dict:
    """The completed steps' rows of ``run``'s metrics.jsonl, by step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/loss" in r}


def assert_same_steps(got: dict, want: dict, rel: float = 1e-5, abs: float = 1e-7) -> None:
    """``got``'s steps (step_rows) repeat ``want``'s in STEP_KEYS."""
    assert set(got) <= set(want), (sorted(got), sorted(want))
    for step, row in got.items():
        for key in STEP_KEYS:
            assert row[key] == pytest.approx(want[step][key], rel=rel, abs=abs), (step, key)
