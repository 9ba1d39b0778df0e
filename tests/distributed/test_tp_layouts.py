"""Trainer steps with tensor parallelism (``parallel.tp``) against the single-process step, on real gloo groups:
tp = 2 for every draft kind, a MoE policy replaying its rollout's routes (also with sequence parallelism) and an
untied head with a bf16 engine copy; dp = 2 × tp = 2 (FSDP2 over dp of the tensor-parallel pieces, and
replicated) and tp = 2 × cp = 2 (4 ranks), with and without sequence parallelism; under the pipeline schedule.
Each compares the loss, both gradient norms, every gradient and every updated weight (gathered), the engine's
whole copy refreshed from the shards (the refit), and each rank's bytes of policy parameters, gradients and
AdamW moments (about half at tp = 2, a quarter at dp = 2 × tp = 2 under FSDP); and the checkpoint of sharded
stages of split layers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codraft.models.hf_io import load_pretrained
from codraft.parallel.data_parallel import local_bytes
from codraft.rl.trainer import Trainer
from dist_harness import run_ranks
from test_dp_step import FOUR, KINDS, _policy, _rank, _same_step, _step
from tiny_runs import run_config


def _one_process(extra: list[str]) -> list[str]:
    """The keys of the one-process reference (sequence parallelism needs tp > 1: the same math without)."""
    return [k for k in extra if not k.startswith("parallel.sequence_parallel")]


def _shares(single, got) -> list[float]:
    """This rank's parameter, gradient and moment bytes as shares of the single process's."""
    whole = local_bytes(single[2][k] for k in single[2] if k.startswith("policy."))
    params, grads, moments, _ = got[4]
    return [params / whole, grads / whole, moments / (2 * whole)]


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_step_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, kind):
    single = _step(tiny_policy_dir, tmp_path / "one", kind, FOUR)
    for got in run_ranks(_rank, 2, tiny_policy_dir, tmp_path / "tp", kind, ["parallel.tp=2", *FOUR]):
        _same_step(got, single)
        assert all(0.45 < s < 0.6 for s in _shares(single, got)), _shares(single, got)  # (the norms: whole)


@pytest.mark.parametrize("which,extra", [("moe", ["grpo.routing_replay=true"]),
                                         ("moe", ["grpo.routing_replay=true", "parallel.sequence_parallel=true"]),
                                         ("untied", ["rollout.dtype=bfloat16"])], ids=["moe", "moe-sequence", "untied"])
def test_tp2_moe_and_untied_policies_equal_single_process(tmp_path, tiny_policy_dir, varied_reward, which, extra):
    """MoE layers run whole on both ranks (their attention split); an untied head split on the vocabulary."""
    policy = _policy(tmp_path, tiny_policy_dir, which)
    single = _step(policy, tmp_path / "one", "dflash", [*FOUR, *_one_process(extra)])
    for got in run_ranks(_rank, 2, policy, tmp_path / "tp", "dflash", ["parallel.tp=2", *FOUR, *extra], timeout=300):
        _same_step(got, single)
        assert got[4][1] == got[4][0]  # every gradient split as its weight (the embedding's too)


@pytest.mark.parametrize("extra,share", [(["parallel.dp=2"], 0.25), (["parallel.dp=2", "parallel.dp_shard=ddp"], 0.5),
                                         (["parallel.cp=2"], 0.5),
                                         (["parallel.dp=2", "parallel.sequence_parallel=true"], 0.25),
                                         (["parallel.cp=2", "parallel.sequence_parallel=true"], 0.5)],
                         ids=["dp2-fsdp", "dp2-ddp", "cp2", "dp2-fsdp-sequence", "cp2-sequence"])
def test_tp2_with_dp_or_cp_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, extra, share):
    single = _step(tiny_policy_dir, tmp_path / "one", "dspark", FOUR)
    for got in run_ranks(_rank, 4, tiny_policy_dir, tmp_path / "tp", "dspark", ["parallel.tp=2", *extra, *FOUR],
                         timeout=300):
        _same_step(got, single)
        assert all(0.9 * share < s < 1.2 * share for s in _shares(single, got)), _shares(single, got)


@pytest.mark.parametrize("extra", [["parallel.microbatches=2"], ["parallel.pp=2"],
                                   ["parallel.pp=2", "parallel.microbatches=2", "parallel.taps=p2p"]],
                         ids=["microbatches2", "pp2", "pp2-microbatches2-p2p"])
def test_tp2_under_the_pipeline_schedule_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, extra):
    """Stages of tensor-parallel layers (global rank = stage · 2 + TP rank): each stage's gradients from its
    ranks, the taps to each TP rank's last stage, the weight sync among the ranks of one TP rank."""
    single = _step(tiny_policy_dir, tmp_path / "one", "dflash", FOUR)
    world = 4 if "parallel.pp=2" in extra else 2
    ranks = run_ranks(_rank, world, tiny_policy_dir, tmp_path / "tp", "dflash", ["parallel.tp=2", *extra, *FOUR],
                      timeout=300)
    for rank, got in enumerate(ranks):
        column = ranks[rank % 2::2]  # this TP rank's stages
        _same_step(got, single, grads={k: v for r in column for k, v in r[1].items()},
                   weights={k: v for r in column for k, v in r[2].items()})


@pytest.mark.parametrize("extra", [["parallel.cp=2"], ["parallel.dp=2"]], ids=["cp2", "dp2-fsdp"])
def test_tp2_pp2_with_a_third_dimension_equals_single_process(tmp_path, tiny_policy_dir, varied_reward, extra):
    """8 ranks: tp = 2 × pp = 2 with cp = 2 (the ring under each stage's split layers) or with dp = 2 (each
    stage's split layers sharded by FSDP2 over its two data ranks; whole pipelines as replicas, dp_shard=ddp,
    were equal too when this was built).
    Global rank = stage · 4 + (dp or CP rank) · 2 + TP rank: a column's stages are r, r + 4."""
    extra = [*extra, "rollout.prompts_per_step=8", "rollout.shards=8"]
    single = _step(tiny_policy_dir, tmp_path / "one", "dspark", extra[-2:])
    ranks = run_ranks(_rank, 8, tiny_policy_dir, tmp_path / "tp", "dspark", ["parallel.tp=2", "parallel.pp=2", *extra],
                      timeout=600)
    for rank, got in enumerate(ranks):
        column = ranks[rank % 4::4]
        _same_step(got, single, grads={k: v for r in column for k, v in r[1].items()},
                   weights={k: v for r in column for k, v in r[2].items()})


def _checkpoint_rank(rank, world, policy_dir, run_dir):
    tr = Trainer(run_config(policy_dir, run_dir, 1, extra=["parallel.tp=2", "parallel.pp=2", "parallel.dp=2",
                                                           "rollout.prompts_per_step=8", "rollout.shards=8"]),
                 progress=False)
    tr.step(0)
    path = tr.save()
    return str(path), {n: p.detach().clone() for n, p in tr.rollout_weights.policy.named_parameters()}


def test_dp2_tp2_pp2_fsdp_checkpoint_holds_the_whole_updated_policy(tmp_path, tiny_policy_dir):
    """Sharded stages of split layers (8 ranks): rank 0's HF folder is the whole policy after the update (gathered
    stage by stage, as the refit fills the engine's copy, which the other tests check against one process)."""
    (path, engine), *_ = run_ranks(_checkpoint_rank, 8, tiny_policy_dir, tmp_path / "run", timeout=300)
    saved = {n: p.detach() for n, p in load_pretrained(Path(path) / "policy").named_parameters()}
    assert saved.keys() == engine.keys()
    assert all(torch.equal(saved[n], engine[n].to(saved[n].dtype)) for n in saved)
