"""Golden metrics: four trainer steps of the tiny preset over committed rollouts, against committed metrics.

Catches silent changes in the training math (the GRPO loss, the draft loss and its weight λ, the
advantages, the optimisers and schedules) that every unit test might miss because each checks one
piece against its own oracle. Nothing here is sampled, so nothing depends on which side of a float's
last digit a uniform draw falls: the policy is the tiny preset's architecture at a seeded random init
(not its warm start, which each machine trains for itself), the draft starts random, and each step's
completions are replayed from ``golden/tiny_rollouts.json`` (sampled once from the warm-started policy;
the prompts are the task stream's own, checked against the file). Every other part of the step runs
for real: the task's rewards, the group advantages, the packed forward, L_RL + λ·L_draft, one backward,
clipping, both optimisers. The metrics then differ between CPUs only in their last digits (kernels
and their dispatch are chosen per machine), far inside the tolerances; a change of the math moves
them by far more (the clip range or λ changed by 10 %: see the closing check).

In codraft's step every rollout batch is used for one update, so the ratio π_θ/π_old is exactly 1
and the clip range cannot move the step's metrics; ``clip_probe`` pins it: the clipped loss of step 0's
batch at a fixed spread of ratios past both clip edges, at the run's `grpo.eps_low`/`eps_high`.

Sampling has its own statistical oracles: tests/unit/test_spec_sampling.py (every draft kind's
speculative samples against the exactly enumerated distribution) and test_spec_mutations.py (their power).

After an intended change of the math, regenerate the metrics (and, with =rollouts, the rollouts too,
from the warm start) and commit them with the change:

    CODRAFT_GOLDEN_UPDATE=1 python -m pytest tests/integration/test_golden.py
"""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from codraft.config import load_config
from codraft.models import Transformer, save_pretrained
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, tiny_model_config
from codraft.rl.grpo import group_advantages, grpo_loss
from codraft.rl.rollout_phase import Rollout
from codraft.rl.trainer import Trainer
from codraft.rollout.engine import GenerationResult
from codraft.tokenizer import CharTokenizer

GOLDEN = Path(__file__).with_name("golden")
ROLLOUTS, METRICS = GOLDEN / "tiny_rollouts.json", GOLDEN / "tiny_metrics.json"
SEED = 1618
OVERRIDES = ["steps=4", f"seed={SEED}", "draft.init=random", "log.val_every=0", "log.speedup_every=0",
             "log.checkpoint_every=0"]
# metric -> (absolute, relative) tolerance, checked as |got - want| <= abs + rel * |want|. The rewards and
# lengths are exact (the same text is scored); the rest leaves room for the last float digits only.
TOLERANCES = {
    "reward_mean": (1e-9, 0.0),
    "completion_len": (1e-9, 0.0),
    "policy/num_tokens": (1e-9, 0.0),
    "policy/loss": (1e-5, 1e-3),
    "policy/entropy": (1e-5, 1e-3),
    "policy/grad_norm": (1e-5, 1e-3),
    "mismatch_kl": (1e-5, 1e-3),
    "draft/loss": (1e-5, 1e-3),
    "draft/acc": (3e-3, 0.0),
    "draft/grad_norm": (1e-5, 1e-3),
    "clip_probe": (1e-6, 1e-4),
}


def _policy_folder(path: Path) -> Path:
    """The tiny preset's policy at a seeded random init, as policy.init reads it."""
    tok = CharTokenizer()
    torch.manual_seed(SEED)
    save_pretrained(Transformer(tiny_model_config(tok)), path,
                    extra_files={CHAR_TOKENIZER_FILE: json.dumps({"alphabet": tok.alphabet})})
    return path


class Replay(Trainer):
    """The trainer with each step's completions read from the golden rollouts instead of sampled."""

    def __init__(self, cfg, steps: list[dict]):
        self.golden_steps = steps
        super().__init__(cfg, progress=False)

    def rollout(self, step: int) -> Rollout:
        saved = self.golden_steps[step]
        problems = self.train_prompts.next(self.cfg.rollout.prompts_per_step)
        assert [p.prompt for p in problems] == saved["prompts"], f"step {step}: the task's prompts changed"
        group = [p for p in problems for _ in range(self.cfg.rollout.group_size)]
        out = [GenerationResult(c["tokens"], c["logprobs"], "eos") for c in saved["completions"]]
        assert len(out) == len(group), f"step {step}: {len(out)} completions for {len(group)} prompts"
        return Rollout(group, [self.tok.prompt_ids(p.prompt) for p in group], out, None, 1.0, 0,
                       {"time_rollout": 1.0})


def _clip_probe(tr: Trainer, saved: dict) -> float:
    """The GRPO loss of step 0's completions and advantages with each token's log-ratio log π_θ/π_old set
    to 0.6·sin(row + position): ratios over e^±0.6, past both clip edges, at the run's `grpo.eps_*`."""
    problems = tr.task.stream("train", seed=tr.cfg.seed)
    group = [p for p in (next(problems) for _ in range(tr.cfg.rollout.prompts_per_step))
             for _ in range(tr.cfg.rollout.group_size)]
    done = saved["completions"]
    rewards = torch.tensor([tr.task.score(p, tr.tok.decode(c["tokens"]))[0] for p, c in zip(group, done)])
    width = max(len(c["tokens"]) for c in done)
    old, mask = torch.zeros(len(done), width), torch.zeros(len(done), width)
    for i, c in enumerate(done):
        old[i, :len(c["tokens"])], mask[i, :len(c["tokens"])] = torch.tensor(c["logprobs"]), 1
    spread = 0.6 * torch.sin(torch.arange(len(done))[:, None] + torch.arange(width)[None, :].float())
    g = tr.cfg.grpo
    loss, _ = grpo_loss(old + spread, old, group_advantages(rewards, tr.cfg.rollout.group_size), mask,
                        eps_low=g.eps_low, eps_high=g.eps_high, norm=g.norm)
    return float(loss)


def _replay(tmp_path: Path, steps: list[dict]) -> list[dict]:
    cfg = load_config(None, [*OVERRIDES, f"policy.init={_policy_folder(tmp_path / 'policy')}",
                             f"run_dir={tmp_path / 'run'}"])
    tr = Replay(cfg, steps)
    tr.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [{"step": r["step"], **{k: float(r[k]) for k in TOLERANCES if k in r}} for r in rows]
    return rows + [{"step": cfg.steps, "clip_probe": _clip_probe(tr, steps[0])}]


def _sample_rollouts(tmp_path: Path) -> list[dict]:
    """Each step's prompts and completions from a real run of the warm-started preset (regeneration only)."""
    cfg = load_config(None, [*OVERRIDES, f"run_dir={tmp_path / 'sampled'}"])
    tr, steps = Trainer(cfg, progress=False), []
    sample = tr.rollout

    def keep(step):
        r = sample(step)
        prompts = [p.prompt for p in r.group[::cfg.rollout.group_size]]
        steps.append({"prompts": prompts, "completions": [
            {"tokens": o.tokens, "logprobs": [round(x, 6) for x in o.logprobs]} for o in r.out]})
        return r
    tr.rollout = keep
    tr.fit()
    return steps


def test_the_tiny_preset_matches_its_golden_metrics(tmp_path):
    update = os.environ.get("CODRAFT_GOLDEN_UPDATE")
    if update == "rollouts":
        ROLLOUTS.write_text(json.dumps({"overrides": OVERRIDES, "steps": _sample_rollouts(tmp_path)}) + "\n")
    saved = json.loads(ROLLOUTS.read_text())
    assert saved["overrides"] == OVERRIDES, "the golden rollouts were sampled for other settings: regenerate them"
    rows = _replay(tmp_path, saved["steps"])
    if update:
        METRICS.write_text(json.dumps({"overrides": OVERRIDES, "rows": rows}, indent=1) + "\n")
        pytest.skip(f"wrote {METRICS}")
    golden = json.loads(METRICS.read_text())
    assert golden["overrides"] == OVERRIDES, "the golden file was written for other settings: regenerate it"
    assert [r["step"] for r in rows] == [r["step"] for r in golden["rows"]]
    off = []
    for got, want in zip(rows, golden["rows"]):
        assert set(got) == set(want), f"step {got['step']}: metrics {sorted(set(got) ^ set(want))} appeared/vanished"
        for k, w in want.items():
            if k == "step":
                continue
            a, r = TOLERANCES[k]
            if not math.isclose(got[k], w, rel_tol=r, abs_tol=a):
                off.append(f"step {got['step']} {k}: {got[k]:.8g}, golden {w:.8g}")
    assert not off, f"metrics moved from {METRICS}:\n" + "\n".join(off)
