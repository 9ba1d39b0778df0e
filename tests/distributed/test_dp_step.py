"""Data parallelism (``parallel.dp``) against the single-process step, on real gloo groups.

A ``dp=2`` trainer step (FSDP2 ``fully_shard`` or ``replicate``, of the policy and the draft) computes
the single-process step over the same rollouts (``rollout.shards=4``): the loss, both gradient norms and
every gradient of policy and draft tensor by tensor, then the same updated weights; the rollout engine's
full copy equals the trainer's weights after the update (the refit); under FSDP each rank holds about
half of the policy's parameters, gradients and AdamW state, and of the draft's parameters. ``dp=2`` with two micro-batches per rank, ``dp=2 × cp=2`` and ``dp=2 × pp=2`` (4 ranks) likewise.
"""
from __future__ import annotations

import pytest
import torch

from codraft.parallel.data_parallel import local_bytes
from codraft.rl import update_phase
from codraft.rl.trainer import Trainer
from codraft.models.layers import whole
from codraft.rollout.weights import cast_for_rollout
from dist_harness import run_ranks
from codraft.tasks import ArithTask
from tiny_runs import alternating_reward, run_config

KINDS = ["dflash", "dspark", "eagle3"]
FOUR = ["rollout.prompts_per_step=4", "rollout.shards=4"]  # 2 groups per DP rank, the same rollouts at any layout


def _step(policy_dir, run_dir, kind, extra):
    """One trainer step: its metrics, the gradients at the commit point, the weights after it, and
    this rank's bytes of policy parameters, gradients and optimiser state."""
    tr = Trainer(run_config(policy_dir, run_dir, 1, kind=kind, extra=["seed=1", *extra]), progress=False)
    seen, commit = {}, update_phase.commit

    def capture(learner, *args):
        seen["grads"] = {f"policy.{n}": whole(p.grad).clone() for n, p in learner.policy.named_parameters()
                         if p.grad is not None}  # (under pp: this stage's)
        seen["grads"].update({f"draft.{n}": whole(p.grad).clone() for n, p in learner.draft.named_parameters()
                              if p.grad is not None})
        seen["bytes"] = [local_bytes(learner.policy.parameters()),
                         local_bytes(p.grad for p in learner.policy.parameters())]
        peak = commit(learner, *args)
        seen["bytes"].append(local_bytes(v for st in learner.optimisers.policy.state.values() for v in st.values()
                                         if torch.is_tensor(v) and v.dim() > 0))
        seen["bytes"].append(local_bytes(learner.draft.trainable_parameters()))
        return peak

    update_phase.commit = capture
    try:
        m = tr.step(0)
    finally:
        update_phase.commit = commit
    weights = {f"policy.{n}": whole(p).detach().clone() for n, p in tr.policy.named_parameters()
               if _held(tr, n)}  # (sharded stages: this stage's)
    weights.update({f"draft.{n}": whole(p).detach().clone() for n, p in tr.draft.named_parameters()
                    if _held(tr, n, tr.draft)})
    tr.rollout_weights.check("after the update")  # the refit copy is the trainer's weights
    refit = {f"policy.{n}": p.detach().clone() for n, p in tr.rollout_weights.policy.named_parameters()}
    # what the trainer's draft reads of the target (fp32), current for the next step's draft loss
    refit.update(zip(("target.embed", "target.head"), (t.detach().clone() for t in tr.rollout_weights.target_parts())))
    return m, seen["grads"], weights, refit, seen["bytes"]


def _held(tr, name, draft=None):
    refit = tr.rollout_weights.refit
    return refit is None or refit.held(draft, name)


def _rank(rank, world, policy_dir, run_dir, kind, extra):
    ArithTask._reward = alternating_reward  # the fixture's, in this process
    return _step(policy_dir, run_dir, kind, extra)


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _same_step(got, want, tol=1e-4, grads=None, weights=None):
    """``grads``, ``weights``: the step's where no one rank holds them all (the stages' together)."""
    m, own, held, refit, _ = got
    m0, grads0, weights0, _, _ = want
    grads = own if grads is None else grads
    weights = held if weights is None else weights
    for k in ("policy/loss", "policy/grad_norm", "draft/loss", "draft/grad_norm", "policy/num_tokens",
              "reward_mean", "acceptance_length"):
        assert float(m[k]) == pytest.approx(float(m0[k]), rel=tol, abs=1e-7), k
    assert grads.keys() == grads0.keys()
    bad = {k: _rel(grads[k], grads0[k]) for k in grads0 if _rel(grads[k], grads0[k]) > tol}
    assert not bad, f"gradients differ: {bad}"
    assert float(m0["policy/grad_norm"]) > 1e-2 and float(m0["draft/grad_norm"]) > 1e-2  # both really train
    bad = {k: _rel(weights[k], weights0[k]) for k in weights0 if _rel(weights[k], weights0[k]) > tol}
    assert not bad, f"updated weights differ: {bad}"
    # the engine's copy (rollout.dtype): the cast of this rank's weights, and of the whole step's
    assert all(torch.equal(refit[k], cast_for_rollout(weights[k], refit[k].dtype)) for k in refit if k in held)
    head = "policy.lm_head.weight" if "policy.lm_head.weight" in weights0 else "policy.embed_tokens.weight"
    whole = {**weights0, "target.embed": weights0["policy.embed_tokens.weight"], "target.head": weights0[head]}
    assert {k for k in refit if _rel(refit[k].float(), whole[k]) > (tol if refit[k].dtype == torch.float32
                                                                     else 1e-2)} == set()


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
@pytest.mark.parametrize("kind", KINDS)
def test_dp2_step_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, kind, mode):
    single = _step(tiny_policy_dir, tmp_path / "one", kind, FOUR)
    ranks = run_ranks(_rank, 2, tiny_policy_dir, tmp_path / "dp", kind, ["parallel.dp=2",
                                                                          f"parallel.dp_shard={mode}", *FOUR])
    for got in ranks:
        _same_step(got, single)
    assert ranks[0][0]["time_step"] == ranks[1][0]["time_step"]  # the slowest rank's, on both
    total = [local_bytes(single[2][k] for k in single[2] if k.startswith("policy."))] * 2
    held = ranks[0][4][:2]
    draft = local_bytes(single[2][k] for k in single[1] if k.startswith("draft."))  # its trained parameters
    if mode == "fsdp":  # about half of the parameters and gradients, and of the AdamW moments; of the draft too
        assert all(0.4 * t < h < 0.6 * t for h, t in zip(held, total)), (held, total)
        assert 0.4 * 2 * total[0] < ranks[0][4][2] < 0.6 * 2 * total[0]
        assert 0.4 * draft < ranks[0][4][3] < 0.6 * draft
    else:
        assert held == total and ranks[0][4][3] == draft


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_dp2_with_microbatches_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, mode):
    """Each DP rank accumulates two micro-batches (the gradient sums after the last)."""
    single = _step(tiny_policy_dir, tmp_path / "one", "dspark", FOUR)
    for got in run_ranks(_rank, 2, tiny_policy_dir, tmp_path / "dp", "dspark",
                         ["parallel.dp=2", f"parallel.dp_shard={mode}", "parallel.microbatches=2", *FOUR]):
        _same_step(got, single)


def test_dp2_cp2_step_equals_single_process(tmp_path, tiny_policy_dir, varied_reward):
    single = _step(tiny_policy_dir, tmp_path / "one", "dflash", FOUR)
    for got in run_ranks(_rank, 4, tiny_policy_dir, tmp_path / "dpcp", "dflash",
                         ["parallel.dp=2", "parallel.cp=2", *FOUR], timeout=300):
        _same_step(got, single)


@pytest.mark.parametrize("mode,microbatches", [("ddp", 1), ("ddp", 2), ("fsdp", 2)])
def test_dp2_pp2_step_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, mode, microbatches):
    """Two stages over two data ranks each (4 ranks): each stage's gradients summed over its data ranks
    (``ddp``: whole pipelines as replicas; ``fsdp``: each stage sharded over its two data ranks, which hold
    half of the stage's parameters, gradients and AdamW state and nothing of the other stage's)."""
    single = _step(tiny_policy_dir, tmp_path / "one", "dflash", FOUR)
    ranks = run_ranks(_rank, 4, tiny_policy_dir, tmp_path / "dppp", "dflash",
                      ["parallel.dp=2", "parallel.pp=2", f"parallel.dp_shard={mode}",
                       f"parallel.microbatches={microbatches}", *FOUR], timeout=300)
    for rank, got in enumerate(ranks):  # global rank = stage · 2 + dp rank: the other stage's are r ± 2
        stages = ranks[rank % 2::2]
        assert {k for r in stages for k in r[1]} == set(single[1])
        _same_step(got, single, grads={k: v for r in stages for k, v in r[1].items()},
                   weights={k: v for r in stages for k, v in r[2].items()})
    if mode == "fsdp":
        for rank, got in enumerate(ranks):
            stage = {k for k in got[2] if k.startswith("policy.")}  # this stage's whole tensors
            total = local_bytes(single[2][k] for k in stage)
            params, grads, moments, _ = got[4]
            assert 0.4 * total < params < 0.6 * total and 0.4 * total < grads < 0.6 * total, (rank, params, total)
            assert 0.4 * 2 * total < moments < 0.6 * 2 * total, (rank, moments, total)


def _policy(tmp_path, tiny_policy_dir, which):
    from tiny_runs import save_tiny_policy
    if which == "untied":
        return save_tiny_policy(tmp_path / "untied", tied=False)
    return save_tiny_policy(tmp_path / "moe", layers=3, moe=True) if which == "moe" else tiny_policy_dir


@pytest.mark.parametrize("kind,which,extra", [
    ("dspark", "untied", ["rollout.dtype=bfloat16"]),  # the draft's target parts from two stages, fp32
    ("dflash", "moe", ["grpo.routing_replay=true"])])
def test_dp2_pp2_fsdp_equals_single_process_for_drafts_and_policies(tmp_path, tiny_policy_dir, varied_reward, kind,
                                                                      which, extra):
    """Sharded stages with an untied LM head (the first stage holds the embedding, the last the head), a bf16
    engine copy and DSpark, and a MoE policy replaying its rollout's routes."""
    policy = _policy(tmp_path, tiny_policy_dir, which)
    single = _step(policy, tmp_path / "one", kind, [*FOUR, *extra])
    ranks = run_ranks(_rank, 4, policy, tmp_path / "dppp", kind,
                      ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", *FOUR, *extra], timeout=300)
    for rank, got in enumerate(ranks):
        stages = ranks[rank % 2::2]
        _same_step(got, single, grads={k: v for r in stages for k, v in r[1].items()},
                   weights={k: v for r in stages for k, v in r[2].items()})


def test_dp2_fsdp_with_a_bf16_engine_copy_equals_single_process(tmp_path, tiny_policy_dir, varied_reward):
    """The refit casts the gathered weights; the draft trains against the fp32 target parts."""
    policy = _policy(tmp_path, tiny_policy_dir, "untied")
    extra = [*FOUR, "rollout.dtype=bfloat16"]
    single = _step(policy, tmp_path / "one", "dspark", extra)
    for got in run_ranks(_rank, 2, policy, tmp_path / "dp", "dspark", ["parallel.dp=2", *extra]):
        _same_step(got, single)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_dp2_moe_policy_with_routing_replay_equals_single_process(tmp_path, varied_reward, mode):
    """A mixture-of-experts policy whose forward replays the rollout's routes, sharded or replicated."""
    from tiny_runs import save_tiny_policy
    policy = save_tiny_policy(tmp_path / "moe", layers=3, moe=True)
    extra = ["grpo.routing_replay=true", *FOUR]
    single = _step(policy, tmp_path / "one", "dflash", extra)
    for got in run_ranks(_rank, 2, policy, tmp_path / "dp", "dflash",
                         ["parallel.dp=2", f"parallel.dp_shard={mode}", *extra], timeout=300):
        _same_step(got, single)


def _experts_rank(rank, world):
    """A MoE layer sharded over 2 ranks whose tokens use disjoint experts (one rank none of 1..3): the
    gradients FSDP sums are the one-process gradients of both ranks' tokens, every expert's defined."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from codraft.models import ModelConfig
    from codraft.models.moe import Routing, SparseMoE
    c = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                    architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4)
    torch.manual_seed(0)
    ref, xs = SparseMoE(c), torch.randn(2, 1, 3, 8)
    routes = torch.tensor([[[[0], [0], [0]]], [[[1], [2], [3]]]])  # (rank, layers, tokens, k)
    holder = torch.nn.Module()
    holder.m = ref
    for r in range(2):  # the reference: both ranks' tokens, the losses summed
        with Routing(holder, routes[r]):
            ref(xs[r]).square().sum().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    moe = SparseMoE(c)
    fully_shard(moe, mesh=init_device_mesh("cpu", (2,)))
    moe.set_force_sum_reduction_for_comms(True)
    moe.set_gradient_divide_factor(1.0)
    holder.m = moe
    with Routing(holder, routes[rank]):
        moe(xs[rank]).square().sum().backward()
    return {n: float((whole(p.grad) - want[n]).abs().max()) for n, p in moe.named_parameters()}


def test_fsdp_with_experts_some_rank_never_uses():
    for errs in run_ranks(_experts_rank, 2):
        assert max(errs.values()) < 1e-6, errs


def test_dp2_pp2_cp2_fsdp_step_equals_single_process(tmp_path, tiny_policy_dir, varied_reward):
    """The three dimensions at once (8 ranks): each stage sharded over its dp × cp ranks (4 per stage), each
    packed row split over a CP pair. Global rank = (stage · 2 + d) · 2 + c: a column's stages are r, r + 4."""
    extra = ["rollout.prompts_per_step=8", "rollout.shards=8"]  # 2 groups per DP rank, the same rollouts
    single = _step(tiny_policy_dir, tmp_path / "one", "dflash", extra)
    ranks = run_ranks(_rank, 8, tiny_policy_dir, tmp_path / "3d", "dflash",
                      ["parallel.dp=2", "parallel.pp=2", "parallel.cp=2", *extra], timeout=600)
    for rank, got in enumerate(ranks):
        column = ranks[rank % 4::4]
        _same_step(got, single, grads={k: v for r in column for k, v in r[1].items()},
                   weights={k: v for r in column for k, v in r[2].items()})
