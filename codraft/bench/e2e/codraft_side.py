"""codraft's side of `codraft bench e2e`: one ``Trainer`` per draft kind, one RL step per ``step()``.

``codraft/<kind>`` is ``codraft.rl.trainer.Trainer`` on the ``smollm2-chainsum`` preset with
``draft.mode=none`` (kind ``none``) or ``draft.mode=cotrain draft.kind=<kind>
draft.init=<settings.draft_init>``: ``offline`` (default) starts from the cached offline-trained
draft (trained on first use, ~12 min per kind on 2 CPU cores), ``random`` from an untrained one.
``log.*`` extras (validation, checkpoints, the plain rollout for the speedup figure unless
``speedup_every``) are off.

Timing comes from the step's own metrics: rollout = ``Engine.generate`` (``time_rollout``);
train = pack + forward + backward + clipping + both optimiser steps (``time_train``); step =
the whole ``Trainer.step`` (rollout + reward + train). The split of train is the trainer's
``PhaseTimer``: ``time_loss_forward`` (``cotrain_loss``, draft loss included), its
``time_draft_loss`` and ``time_optimizer`` (the optimiser steps); bwd+clip is what is left.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from codraft.bench import CpuMeter
from codraft.config import load_config
from codraft.rl.trainer import Trainer

PRESET = "smollm2-chainsum"


def _f(x) -> float | None:
    return None if x is None else float(x)


def side_overrides(kind: str, settings, run_dir: Path) -> list[str]:
    """The codraft config overrides of one side (``settings``: the run's ``Settings``)."""
    s = settings
    ov = [f"policy.init={s.policy}", f"task.name={s.task}", f"seed={s.seed}", f"run_dir={run_dir}",
          f"rollout.prompts_per_step={s.prompts}", f"rollout.group_size={s.group}",
          f"rollout.max_new_tokens={s.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
          "grpo.kl_coef=0", f"grpo.lr={s.lr}", "log.val_every=0", f"log.speedup_every={s.speedup_every}",
          "log.checkpoint_every=0", f"draft.gamma={s.gamma}",
          "rollout.draft_length=fixed", "draft.num_anchors=0"]  # the preset's auto/16: pass as overrides
    ov += ["draft.mode=none"] if kind == "none" else ["draft.mode=cotrain", f"draft.kind={kind}",
                                                       f"draft.init={s.draft_init}"]
    # no draft, nothing to size: an overrides' rollout.draft_length=auto is for the draft sides
    return ov + list(s.overrides) + (["rollout.draft_length=fixed"] if kind == "none" else [])


class CodraftSide:
    """One codraft ``Trainer`` (one draft kind) that takes one RL step per ``step()`` call."""

    def __init__(self, kind: str, settings, run_dir: Path):

        self.name = f"codraft/{kind}"
        self.kind = kind
        self.cfg = load_config(PRESET, side_overrides(kind, settings, run_dir))
        t = time.perf_counter()
        self.trainer = Trainer(self.cfg, progress=False)
        self.init_s = time.perf_counter() - t
        self.steps_done = 0
        self.records: list[dict] = []
        draft = self.trainer.draft
        self.trainable_draft_params = sum(p.numel() for p in draft.parameters() if p.requires_grad) \
            if isinstance(draft, torch.nn.Module) else 0

    def prompt_ids(self, n_steps: int) -> list[list[int]]:
        """The prompt ids this side will see in its first ``n_steps`` steps (one per problem)."""
        tr = self.trainer
        stream = tr.task.stream("train", seed=self.cfg.seed)
        return [tr.tok.prompt_ids(next(stream).prompt) for _ in range(n_steps * self.cfg.rollout.prompts_per_step)]

    def step(self) -> dict:
        meter = CpuMeter()
        m = self.trainer.step(self.steps_done)
        load = meter.read()
        stats, lens = self.trainer.last_stats, [len(o.tokens) for o in self.trainer.last_rollout]
        fwd, opt = m["time_loss_forward"], m["time_optimizer"]
        rec = {"step": self.steps_done, "rollout_s": m["time_rollout"], "train_s": m["time_train"],
               "step_s": m["time_step"], "train_forward_s": fwd, "draft_forward_s": m.get("time_draft_loss", 0.0),
               "optimizer_s": opt, "train_backward_s": m["time_train"] - fwd - opt,
               "other_s": m["time_step"] - m["time_rollout"] - m["time_train"],
               "completion_len": _f(m["completion_len"]), "reward_mean": _f(m["reward_mean"]),
               "completion_max": max(lens) if lens else None,
               "decode_rounds": stats.rounds,
               "tokens_per_s": _f(m["tokens_per_s"]),
               "acceptance_length": _f(m.get("acceptance_length")),
               "acceptance_per_position": m.get("acceptance_per_position"), "gamma_chosen": m.get("gamma_chosen"),
               "rollout_plain_s": _f(m.get("time_rollout_plain")), "rollout_speedup": _f(m.get("rollout_speedup")),
               "draft_loss": _f(m.get("draft/loss")), "engine": stats.as_dict(),
               "others_cores": load.get("others_cores"),
               "stolen_cores": load.get("stolen_cores"), "torch_threads": torch.get_num_threads()}
        self.records.append(rec)
        self.steps_done += 1
        return rec

    def close(self):
        self.trainer.logger.close()
