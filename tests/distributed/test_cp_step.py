"""One co-training step under context parallelism equals the single-process step: loss, draft
loss, metrics, gradient norms and every parameter's gradient, for each draft kind, on real gloo
groups of 2 and 4 ranks (the single-process step runs in each rank as the reference)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from codraft.drafts import init_draft
from codraft.models import Transformer
from codraft.parallel.comm import Group
from codraft.parallel.gradients import clip_grad_norm, sync_gradients
from codraft.policy.warmstart import tiny_model_config
from codraft.rl.cotrain import cotrain_loss
from codraft.models.layers import whole
from codraft.tasks import make_task
from codraft.tokenizer import CharTokenizer
from codraft.train.packing import pack
from dist_harness import run_ranks
from precision_probe import Products

RTOL = 1e-4


def _batch(seed, groups=3, group_size=2, long=False):
    """GRPO-shaped rollouts: groups of completions sharing a prompt, uneven lengths; ``long``: the
    prompts of the long-context preset's task (arith_haystack, 0.8-2K characters)."""
    g = torch.Generator().manual_seed(seed)
    tok = CharTokenizer()
    prompts, completions, logprobs = [], [], []
    for i in range(groups):
        if long:
            chars = int(torch.randint(800, 2000, (1,), generator=g))
            p = tok.prompt_ids(make_task("arith_haystack", context_chars=chars).sample("train", 1, seed=i)[0].prompt)
        else:
            n = int(torch.randint(20, 160, (1,), generator=g))
            p = tok.prompt_ids("".join(str(int(d)) for d in torch.randint(0, 10, (n,), generator=g)) + "=")
        for _ in range(group_size):
            m = int(torch.randint(1, 40, (1,), generator=g))
            completions.append(torch.randint(3, tok.vocab_size, (m,), generator=g).tolist())
            logprobs.append((-torch.rand(m, generator=g) * 3).tolist())
            prompts.append(p)
    adv = torch.randn(len(prompts), generator=g)
    return pack(prompts, completions, logprobs), adv


def _models(kind, moe=False):
    """The tiny policy (``moe``: as a Qwen3-MoE target, 4 experts, top-2, its first layer dense) and a draft."""
    tok = CharTokenizer()
    cfg = tiny_model_config(tok)
    if moe:
        cfg = dataclasses.replace(cfg, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=96, mlp_only_layers=[0], norm_topk_prob=True)
    torch.manual_seed(0)
    policy = Transformer(cfg)
    draft = init_draft(kind, policy, gamma=3, **({"num_anchors": 8} if kind in ("dflash", "dspark") else {}))
    return policy, draft


def _step(policy, draft, batch, adv, cp, reference, kl, dtype=torch.float32, temperature=1.0, clip=1e9):
    """One step's loss, metrics, whole gradients (clipped to ``clip``) and norms; ``dtype``: the policy's and
    the draft's products. (Also the tensor-parallel step's: its gradients gathered from their shards.)"""
    policy.zero_grad(set_to_none=True)
    draft.zero_grad(set_to_none=True)
    loss, m = cotrain_loss(policy, draft, batch, adv, temperature=temperature, lam=0.7, eps_low=0.2, eps_high=0.28,
                           norm="token" if kl == 0 else "sequence", kl_coef=kl, reference=reference, cp=cp,
                           policy_dtype=dtype, draft_dtype=dtype, draft_seed=5)
    loss.backward()
    dparams = list(draft.trainable_parameters())
    if cp is not None:
        sync_gradients(policy.parameters(), cp, "policy")
        sync_gradients(dparams, cp, "draft")
    norms = {"policy": clip_grad_norm(policy.parameters(), clip), "draft": clip_grad_norm(dparams, clip)}
    grads = {f"policy.{n}": whole(p.grad).clone() for n, p in policy.named_parameters()}
    grads.update({f"draft.{i}": p.grad.clone() for i, p in enumerate(dparams)})
    return float(loss), {k: float(v) for k, v in m.items() if torch.is_tensor(v) and v.numel() == 1}, grads, norms


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if torch.is_tensor(a) else \
        abs(a - b) / max(abs(b), 1e-6)


def _compare(rank, world, kinds, long=False):
    comm = Group.world(timeout=60)
    out = {}
    for kind in kinds:
        for kl in ((0.0,) if long else (0.0, 0.05)):
            policy, draft = _models(kind)
            reference = None
            if kl:
                torch.manual_seed(9)
                reference = Transformer(policy.config).requires_grad_(False)
            batch, adv = _batch(seed=3, groups=2 if long else 3, long=long)
            ref = _step(policy, draft, batch, adv, None, reference, kl)
            got = _step(policy, draft, batch, adv, comm, reference, kl)
            errs = {"loss": _rel(got[0], ref[0])}
            errs.update({f"metric {k}": _rel(got[1][k], v) for k, v in ref[1].items()})
            errs.update({f"grad {k}": _rel(got[2][k], v) for k, v in ref[2].items()})
            errs.update({f"norm {k}": _rel(float(got[3][k]), float(v)) for k, v in ref[3].items()})
            assert set(got[1]) == set(ref[1]) and set(got[2]) == set(ref[2])
            out[(kind, kl)] = errs
    return out


@pytest.mark.parametrize("world,kinds,long", [(2, ("eagle3", "dflash", "dspark", "model"), False),
                                             (4, ("eagle3", "dspark"), False), (2, ("eagle3", "dspark"), True)])
def test_cp_step_equals_single_process(world, kinds, long):
    for rank, res in enumerate(run_ranks(_compare, world, kinds, long, timeout=300)):
        for case, errs in res.items():
            bad = {k: e for k, e in errs.items() if not e <= RTOL}
            assert not bad, f"C={world} rank {rank} {case}: relative differences above {RTOL}: {bad}"


def bf16_gap(ref32, ref16, got16) -> dict:
    """How far a split bf16 step (``got16``) is from the single-process bf16 step: the gradients (all of
    them, one vector) as a share of how far bf16 itself moves them from fp32, and the loss relative to
    itself. Split over rows, each rank rounds its own share of a weight's gradient to bf16 (the bf16
    product's output) before the ranks sum them, so the gradients differ by about a third of bf16's own
    move (2 ranks); a split that missed the bf16 products would be at ~1."""
    def flat(step):
        return torch.cat([g.flatten() for _, g in sorted(step[2].items())])
    return {"grads": float((flat(got16) - flat(ref16)).norm() / (flat(ref16) - flat(ref32)).norm()),
            "loss": _rel(got16[0], ref16[0])}


def _compare_bf16(rank, world, kind):
    comm = Group.world(timeout=60)
    policy, draft = _models(kind)
    batch, adv = _batch(seed=3)
    ref32 = _step(policy, draft, batch, adv, None, None, 0.0)
    ref16 = _step(policy, draft, batch, adv, None, None, 0.0, torch.bfloat16)
    with Products() as seen:
        got16 = _step(policy, draft, batch, adv, comm, None, 0.0, torch.bfloat16)
    return bf16_gap(ref32, ref16, got16), seen.dtypes


def test_cp_step_in_bf16_products_is_the_single_process_bf16_step():
    """grpo.precision / draft.precision = bfloat16 under CP: every product on every rank runs in bf16, and
    the step is the single-process bf16 step up to bf16's rounding of each rank's share."""
    for rank, (gap, dtypes) in enumerate(run_ranks(_compare_bf16, 2, "dspark", timeout=300)):
        assert dtypes == {torch.bfloat16}, f"rank {rank}: products in {dtypes}"
        assert gap["grads"] < 0.6 and gap["loss"] < RTOL, f"rank {rank}: {gap}"
