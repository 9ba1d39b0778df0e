"""Step 4 of an RL step (``Trainer.observe``): the step's metrics row, which the trainer's loop logs
(metrics.jsonl / TensorBoard, rank 0); every `log.val_every` steps it also holds the held-out accuracy.
Over several ranks the rollouts and losses are already the whole step's (gathered, merged); the times
are the slowest rank's.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

from codraft.config import RunConfig
from codraft.rl.rollout_phase import Probes, Rollout
from codraft.rl.scoring import Scored
from codraft.rl.update_phase import Update

SAMPLED_PROMPTS = 2  # log.samples_every shows every completion of the step's first this-many prompts


class Observer:
    """Step 4, and what it keeps from step to step: how many steps in a row had no learning signal."""

    def __init__(self, cfg: RunConfig, tok, world, is_main: bool):
        self.cfg, self.tok, self.world, self.is_main = cfg, tok, world, is_main
        self.no_signal_streak = 0  # steps in a row whose advantages were all 0 (log.no_signal_steps)

    def observe(self, step: int, rollout: Rollout, probes: Probes, scored: Scored, update: Update, t_step: float,
                *, lr: float, logger, validate: Callable[[], float]) -> dict:
        """4. The step's metrics row (``lr``: the policy's this step); every `log.val_every` steps also the
        held-out accuracy (``validate``). The sampled completions go to ``logger``."""
        m = {**rollout.metrics, **probes.metrics, "reward_errors": len(scored.errors),
             "policy/grad_norm": update.policy_grad_norm}
        if update.draft_grad_norm is not None:
            m["draft/grad_norm"] = update.draft_grad_norm
        m.update(skipped_update=int(not update.finite), nonfinite_streak=update.nonfinite_streak)
        m.update({f"time_{k}": v for k, v in update.timings.items()})  # time_train and its breakdown
        if update.refit_peak is not None:  # (sharded: what gathering the shards added at its peak)
            m["refit_peak_bytes"] = update.refit_peak
        m.update(update.metrics)
        lm, rewards, lens = update.metrics, scored.rewards, [len(o.tokens) for o in rollout.out]
        if scored.kept is not None and not bool(scored.kept.all()):  # (dropped samples have no reward)
            rewards = rewards[scored.kept] if bool(scored.kept.any()) else rewards.new_zeros(1)
        m.update(scored.metrics)  # reward/NAME_mean per reward function, reward_dropped
        m.update(reward_mean=rewards.mean(), reward_std=rewards.std() if len(rewards) > 1 else 0.0,
                 completion_len=sum(lens) / len(lens), lr=lr, mismatch_kl=lm.get("policy/rollout_kl"),
                 token_mult_prob_error=lm.get("policy/token_mult_prob_error"))
        # step time = rollout + reward + train; the measurement extras are not part of it
        m["time_step"] = time.perf_counter() - t_step - probes.seconds
        if self.world is not None:  # times are the slowest rank's (the others wait for it)
            times = self.world.all_gather_object({k: float(v) for k, v in m.items() if k.startswith("time_")},
                                                 "the ranks' step times")
            m.update({k: max(t.get(k, 0.0) for t in times) for k in dict.fromkeys(k for t in times for k in t)})
        m["time_rollout_share"] = m["time_rollout"] / m["time_step"]  # (of the slowest rank's times)
        if self.cfg.log.val_every and (step + 1) % self.cfg.log.val_every == 0:
            m["val_accuracy"] = validate()
        m["tokens_per_s"] = sum(lens) / rollout.seconds
        self._show(step, rollout, scored, logger)
        return m

    def _show(self, step: int, rollout: Rollout, scored: Scored, logger) -> None:
        """What the policy writes (`log.samples_every`: samples.jsonl, TensorBoard), and a warning when no group
        has had a learning signal (every completion of each prompt got one reward) for `log.no_signal_steps` in a
        row."""
        log, group_size = self.cfg.log, self.cfg.rollout.group_size
        if log.samples_every and (step + 1) % log.samples_every == 0:
            n = min(len(rollout.out), SAMPLED_PROMPTS * group_size)
            kept = scored.kept if scored.kept is not None else [True] * len(rollout.out)
            logger.samples(step + 1, [
                {"prompt": p.prompt, "completion": self.tok.decode(o.tokens),
                 "reward": float(r) if k else None, "advantage": float(a)}
                for p, o, r, a, k in zip(rollout.group[:n], rollout.out[:n], scored.rewards.tolist(),
                                         scored.advantages.tolist(), kept)])
        self.no_signal_streak = self.no_signal_streak + 1 if not bool(scored.advantages.any()) else 0
        if log.no_signal_steps and self.no_signal_streak == log.no_signal_steps and self.is_main:
            warnings.warn(f"steps {step + 2 - log.no_signal_steps}-{step + 1}: every prompt's {group_size} "
                          "completions got one reward, so every advantage is 0 and the policy does not learn; try "
                          "more completions per prompt (rollout.group_size), other prompts or a finer reward",
                          stacklevel=4)  # at Trainer.step
