"""One co-training step under tensor parallelism (``parallel.tp``, ``codraft.parallel.tp``) equals the
single-process step on real gloo groups: the loss, every metric, both clipped gradient norms and every
gradient of the policy (gathered from its shards) and of the draft, for each draft kind, a dense and a MoE
policy, with and without the KL reference, and with sequence parallelism (the residual stream and the norms
split along the sequence); tp = 2 alone and tp = 2 × cp = 2 (4 ranks). The single-process
step runs in each rank as the reference. Also: the products really split (each rank holds its share of
every planned weight, and the logits stay split on the vocabulary), and bf16 products run on the shards."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from codraft.models import Transformer
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.tp import mean_entropy, parallelize_tp, plan, token_logprobs
from dist_harness import run_ranks
from precision_probe import Products
from test_cp_step import RTOL, _batch, _models, _rel
from test_cp_step import _step as cp_step


def _step(policy, draft, batch, adv, mesh, reference, kl, dtype=torch.float32):
    """One step's loss, metrics, whole gradients (clipped) and norms (``mesh``: the layout's, or None)."""
    return cp_step(policy, draft, batch, adv, None if mesh is None else mesh.cp_group, reference, kl, dtype,
                   temperature=0.9, clip=0.5)


def _errors(got, ref) -> dict:
    assert set(got[1]) == set(ref[1]) and set(got[2]) == set(ref[2])
    errs = {"loss": _rel(got[0], ref[0])}
    errs.update({f"metric {k}": _rel(got[1][k], v) for k, v in ref[1].items()})
    errs.update({f"grad {k}": _rel(got[2][k], v) for k, v in ref[2].items()})
    errs.update({f"norm {k}": _rel(got[3][k], v) for k, v in ref[3].items()})
    return errs


def _split(policy, mesh):
    """Each planned weight's local rows or columns against its whole size, whether the logits stay split, and
    whether the residual stream is split along the sequence (sequence parallelism)."""
    shares = {}
    for name in plan(policy):
        w = policy.get_submodule(name).weight
        shares[name] = (w.to_local().numel(), w.numel())
    h = torch.randn(3, policy.config.hidden_size)
    logits = policy.logits(h)
    x = policy.embed(torch.zeros(1, 5, dtype=torch.long))
    return shares, isinstance(logits, DTensor) and logits.to_local().shape[-1] < logits.shape[-1], \
        isinstance(x, DTensor) and x.to_local().shape[1] < 5


def _compare(rank, world, layout, cases):
    mesh = build_mesh(layout, timeout=60)
    out = {}
    for kind, moe, kl, *sequence in cases:
        policy, draft = _models(kind, moe=moe)
        reference = None
        if kl:
            torch.manual_seed(9)
            reference = Transformer(policy.config).requires_grad_(False)
        batch, adv = _batch(seed=3)
        ref = _step(policy, draft, batch, adv, None, reference, kl)
        policy_tp = parallelize_tp(copy.deepcopy(policy), mesh.tp_mesh, *sequence)  # (the draft: the whole head)
        got = _step(policy_tp, draft, batch, adv, mesh, reference, kl)
        out[(kind, moe, kl, *sequence)] = _errors(got, ref), _split(policy_tp, mesh)
    return out


CASES = [("eagle3", False, 0.0), ("dflash", False, 0.05), ("dspark", False, 0.0), ("model", False, 0.0),
         ("dspark", True, 0.0), ("eagle3", True, 0.05)]
SEQUENCE = [("eagle3", False, 0.0, True), ("dflash", False, 0.05, True), ("dspark", True, 0.0, True)]  # + sequence


@pytest.mark.parametrize("layout,cases", [(Layout(tp=2), CASES + SEQUENCE),
                                          (Layout(tp=2, cp=2), [("eagle3", False, 0.0), ("dspark", True, 0.05),
                                                                ("dflash", True, 0.0, True)])],
                         ids=["tp2", "tp2xcp2"])
def test_tp_step_equals_single_process(layout, cases):
    for rank, res in enumerate(run_ranks(_compare, layout.world, layout, cases, timeout=400)):
        for case, (errs, (shares, logits_split, sequence_split)) in res.items():
            bad = {k: e for k, e in errs.items() if not e <= RTOL}
            assert not bad, f"{layout} rank {rank} {case}: relative differences above {RTOL}: {bad}"
            assert logits_split and sequence_split == (len(case) == 4), (rank, case)
            # every planned weight: this rank holds its share (the vocabulary's may be uneven)
            assert all(abs(local / whole - 1 / layout.tp) < 0.02 for local, whole in shares.values()), shares


def _compare_bf16(rank, world, kind):
    mesh = build_mesh(Layout(tp=2), timeout=60)
    policy, draft = _models(kind)
    batch, adv = _batch(seed=3)
    ref32 = _step(policy, draft, batch, adv, None, None, 0.0)
    ref16 = _step(policy, draft, batch, adv, None, None, 0.0, torch.bfloat16)
    policy_tp = parallelize_tp(copy.deepcopy(policy), mesh.tp_mesh)
    with Products() as seen:
        got16 = _step(policy_tp, draft, batch, adv, mesh, None, 0.0, torch.bfloat16)
    def flat(step):
        return torch.cat([g.flatten() for _, g in sorted(step[2].items())])
    move = (flat(ref16) - flat(ref32)).norm()  # how far bf16 moves the single-process gradients
    return {"to bf16": float((flat(got16) - flat(ref16)).norm() / move),
            "to fp32": float((flat(got16) - flat(ref32)).norm() / move), "loss": _rel(got16[0], ref16[0])}, seen.dtypes


def test_tp_step_in_bf16_products_is_the_single_process_bf16_step():
    """grpo.precision=bfloat16 under tp: the products on the shards run in bf16, and the step is nearer the
    single-process bf16 step than bf16 itself moves it from fp32: each rank rounds its partial sums of the
    row-wise products, so they differ by about two thirds of that move; a split that ran the products in fp32
    would be 1 move from the bf16 step and 0 from the fp32 one."""
    for rank, (gap, dtypes) in enumerate(run_ranks(_compare_bf16, 2, "dspark", timeout=300)):
        assert dtypes == {torch.bfloat16}, f"rank {rank}: products in {dtypes}"
        assert gap["to bf16"] < 0.8 < gap["to fp32"] and gap["loss"] < 1e-3, f"rank {rank}: {gap}"


def _split_logprobs(rank, world):
    """Each rank holds its columns of an 11-column vocabulary (6 and 5: uneven), as a DTensor."""
    torch.manual_seed(0)
    z, ids, w = torch.randn(5, 11), torch.tensor([0, 3, 10, 7, 5]), torch.randn(5)
    whole = z.clone().requires_grad_(True)
    want = torch.log_softmax(whole, -1).gather(-1, ids[:, None]).squeeze(-1)
    (want * w).sum().backward()
    p = torch.softmax(z, -1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    split = distribute_tensor(z, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), [Shard(1)])
    split.requires_grad_(True)
    got = token_logprobs(split, ids)
    (got * w).sum().backward()
    return (float((got - want).abs().max()), float((split.grad.full_tensor() - whole.grad).abs().max()),
            abs(float(mean_entropy(split)) - entropy))


def test_split_logprobs_and_entropy_are_the_whole_vocabularys():
    """The vocabulary-split logprob (three all-reduces forward, a hand-written backward) against autograd through
    the whole log-softmax, and the split entropy against the whole one."""
    for errs in run_ranks(_split_logprobs, 2):
        assert max(errs) < 1e-6, errs
