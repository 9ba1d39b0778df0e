"""One co-training step under pipeline parallelism (and PP × CP) equals the single-process step over
the same micro-batches: loss, draft loss, metrics, gradient norms and every gradient of the policy
and the draft, on real gloo groups (PP = 2 and 4; PP = 2 × CP = 2), for every tap transport. The
single-process reference runs in every rank. Also: micro-batching itself is exact for the RL loss
(M micro-batches = one batch), and M = 1 is the plain step."""
from __future__ import annotations

import pytest
import torch

from codraft.models import Transformer
from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.pipeline import one_f_one_b, stage_layers, PipelineError
from codraft.rl.cotrain import cotrain_loss
from codraft.rl.microbatch import split_microbatches
from codraft.parallel.gradients import clip_stage_gradients, reduce_stage_gradients, sync_stage_weights
from codraft.parallel.pipeline import stage_parameters
from codraft.parallel.stages import build_pipeline
from codraft.rl.pipelined import pipeline_cotrain
from dist_harness import run_ranks
from test_cp_step import _models, _rel, bf16_gap
from precision_probe import Products

RTOL = 1e-4
LOSS_KW = dict(temperature=1.0, lam=0.7, eps_low=0.2, eps_high=0.28, norm="token")


def _rollouts(seed, groups=4, group_size=2):
    g = torch.Generator().manual_seed(seed)
    prompts, completions, logprobs = [], [], []
    for _ in range(groups):
        p = torch.randint(3, 20, (int(torch.randint(10, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            m = int(torch.randint(2, 30, (1,), generator=g))
            completions.append(torch.randint(3, 20, (m,), generator=g).tolist())
            logprobs.append((-torch.rand(m, generator=g) * 3).tolist())
            prompts.append(p)
    return prompts, completions, logprobs, torch.randn(len(prompts), generator=g)


def _observations(completions, seed=11):
    """Multi-turn masks: an observation of 1-4 tokens after a turn of the completion (False: not the
    policy's), in about half the completions."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for c in completions:
        m = [True] * len(c)
        if len(c) > 6 and torch.rand(1, generator=g) < 0.6:
            at, n = int(torch.randint(1, len(c) - 5, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
            m[at:at + n] = [False] * n
        masks.append(m)
    return masks


def _grads(policy, draft=None):
    out = {f"policy.{n}": p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    if draft is not None:
        out.update({f"draft.{i}": p.grad.clone() for i, p in enumerate(draft.trainable_parameters())
                    if p.grad is not None})
    return out


def _routes(prompts, completions, moe_layers=3, experts=4, k=2, seed=13):
    """Routing replay: random distinct experts for every token of every sequence."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(len(p) + len(c), moe_layers, experts, generator=g).argsort(-1)[..., :k]
            for p, c in zip(prompts, completions)]


def _step(kind, mesh, transport, microbatches, kl=0.0, dtype=torch.float32, multiturn=False, moe=False, replay=False):
    """One step's loss, metrics, gradients and norms; ``dtype``: the policy's and the draft's products;
    ``multiturn``: completions with observations in them (masked out of every loss); ``moe``: a MoE policy,
    ``replay``: routed as random rollout routes say."""
    policy, draft = _models(kind, moe)
    reference = None
    if kl:
        torch.manual_seed(9)
        reference = Transformer(policy.config).requires_grad_(False)
    prompts, completions, logprobs, adv = _rollouts(3)
    masks = _observations(completions) if multiturn else None
    mbs = split_microbatches(prompts, completions, logprobs, adv, 2, microbatches, "cpu", masks,
                             _routes(prompts, completions) if replay else None)
    pipe = build_pipeline(policy, draft, mesh, transport=transport, max_tokens=1024, timeout=60)
    loss, m = pipeline_cotrain(pipe, policy, draft, mbs, step=7, reference=reference, kl_coef=kl, policy_dtype=dtype,
                               draft_dtype=dtype, draft_seed=5, **LOSS_KW)
    dparams = list(draft.trainable_parameters())
    own, drafts = reduce_stage_gradients(pipe, policy, dparams)
    grads = _grads(policy, draft)  # this stage's (the others' parameters have none)
    if mesh is not None and mesh.pp > 1:  # every stage's, to compare with the reference
        for share in mesh.world.all_gather_object(grads, "grads"):
            grads.update(share)
    norms = clip_stage_gradients(pipe, policy, own, drafts, 1e9, 1e9)
    if pipe.channel is not None:
        pipe.channel.close()
    return float(loss), {k: float(v) for k, v in m.items() if torch.is_tensor(v) and v.numel() == 1}, grads, \
        [float(n) for n in norms]


def _compare(rank, world, pp, cp, kinds, transports, microbatches, kl=0.0, multiturn=False, moe=False, replay=False):
    mesh = build_mesh(Layout(pp=pp, cp=cp), timeout=60)
    out = {}
    for kind in kinds:
        ref = _step(kind, None, "shm", microbatches, kl, multiturn=multiturn, moe=moe, replay=replay)
        for transport in transports:
            got = _step(kind, mesh, transport, microbatches, kl, multiturn=multiturn, moe=moe, replay=replay)
            errs = {"loss": _rel(got[0], ref[0])}
            errs.update({f"metric {k}": _rel(got[1][k], v) for k, v in ref[1].items()})
            errs.update({f"grad {k}": _rel(got[2][k], v) for k, v in ref[2].items()})
            errs.update({f"norm {i}": _rel(a, b) for i, (a, b) in enumerate(zip(got[3], ref[3]))})
            if replay:  # (and the replayed routes are what the forward used: the own routing's loss differs)
                own = _step(kind, None, "shm", microbatches, kl, multiturn=multiturn, moe=moe)[0]
                errs["replay is applied (0 = yes)"] = float(_rel(own, ref[0]) <= 1e-7)
            assert set(got[1]) == set(ref[1]), set(got[1]) ^ set(ref[1])
            assert set(got[2]) == set(ref[2]), set(got[2]) ^ set(ref[2])
            out[(kind, transport)] = errs
    return out


@pytest.mark.parametrize("pp,cp,kinds,transports,microbatches,kl", [
    (2, 1, ("dflash", "eagle3"), ("shm", "p2p", "staging", "relay"), 2, 0.0),
    (2, 1, ("dspark",), ("shm",), 4, 0.05),
    (4, 1, ("dspark", "eagle3"), ("shm", "p2p"), 3, 0.0),
    (2, 2, ("dflash", "eagle3"), ("shm",), 2, 0.05),
])
def test_pp_step_equals_single_process(pp, cp, kinds, transports, microbatches, kl):
    for rank, res in enumerate(run_ranks(_compare, pp * cp, pp, cp, kinds, transports, microbatches, kl,
                                         timeout=400)):
        for case, errs in res.items():
            bad = {k: e for k, e in errs.items() if not e <= RTOL}
            assert not bad, f"PP={pp} CP={cp} rank {rank} {case}: relative differences above {RTOL}: {bad}"


@pytest.mark.parametrize("pp,cp,kinds,microbatches", [(2, 1, ("dflash", "eagle3"), 2), (1, 2, ("dspark",), 1)])
def test_multiturn_step_equals_single_process(pp, cp, kinds, microbatches):
    """Episodes with observations (masked out of the RL, KL and draft losses) through PP = 2 and CP = 2."""
    for rank, res in enumerate(run_ranks(_compare, pp * cp, pp, cp, kinds, ("shm",), microbatches, 0.05, True,
                                         timeout=300)):
        for case, errs in res.items():
            bad = {k: e for k, e in errs.items() if not e <= RTOL}
            assert not bad, f"multi-turn PP={pp} CP={cp} rank {rank} {case}: relative differences above {RTOL}: {bad}"


@pytest.mark.parametrize("pp,cp,kinds,microbatches,replay", [(2, 1, ("dflash", "eagle3"), 2, False),
                                                              (1, 2, ("dspark",), 1, False),
                                                              (2, 1, ("eagle3",), 2, True), (1, 2, ("dflash",), 2, True)])
def test_moe_step_equals_single_process(pp, cp, kinds, microbatches, replay):
    """A mixture-of-experts policy (dense and sparse layers) through PP = 2 and CP = 2, with each draft kind,
    and with its routes replayed."""
    for rank, res in enumerate(run_ranks(_compare, pp * cp, pp, cp, kinds, ("shm",), microbatches, 0.05, False, True,
                                         replay, timeout=300)):
        for case, errs in res.items():
            bad = {k: e for k, e in errs.items() if not e <= RTOL}
            assert not bad, f"MoE PP={pp} CP={cp} rank {rank} {case}: relative differences above {RTOL}: {bad}"


def _compare_bf16(rank, world, pp, cp, kind, transport):
    mesh = build_mesh(Layout(pp=pp, cp=cp), timeout=60)
    ref32, ref16 = (_step(kind, None, "shm", 2, dtype=d) for d in (torch.float32, torch.bfloat16))
    with Products() as seen:
        got16 = _step(kind, mesh, transport, 2, dtype=torch.bfloat16)
    return bf16_gap(ref32, ref16, got16), seen.dtypes


@pytest.mark.parametrize("pp,cp,kind,transport", [(2, 1, "dspark", "shm"), (2, 2, "eagle3", "p2p")])
def test_pp_step_in_bf16_products_is_the_single_process_bf16_step(pp, cp, kind, transport):
    """bf16 products under PP (and PP × CP): every stage's products run in bf16, and the step is the
    single-process bf16 step (under PP alone, up to fp32 rounding: each stage runs the same rows)."""
    for rank, (gap, dtypes) in enumerate(run_ranks(_compare_bf16, pp * cp, pp, cp, kind, transport, timeout=300)):
        assert dtypes == {torch.bfloat16}, f"rank {rank}: products in {dtypes}"
        bound = 0.6 if cp > 1 else 0.01
        assert gap["grads"] < bound and gap["loss"] < RTOL, f"PP={pp} CP={cp} rank {rank}: {gap}"


def test_microbatches_add_up_to_the_batch():
    """The RL loss over M micro-batches (global normalisers) is the one-batch loss, gradients too;
    M = 1 through the pipeline code is exactly the plain step (draft included)."""
    prompts, completions, logprobs, adv = _rollouts(4)
    for norm in ("token", "sequence"):
        kw = {**LOSS_KW, "norm": norm}
        policy, draft = _models("dflash")
        one = split_microbatches(prompts, completions, logprobs, adv, 2, 1, "cpu")
        loss, _ = cotrain_loss(policy, draft, one[0].batch, adv, draft_seed=5, **kw)
        loss.backward()
        plain = (float(loss.detach()), _grads(policy, draft))
        policy.zero_grad(set_to_none=True), draft.zero_grad(set_to_none=True)
        pipe = build_pipeline(policy, draft, None)
        loss1, _ = pipeline_cotrain(pipe, policy, draft, one, step=0, draft_seed=5, **kw)
        assert float(loss1) == plain[0]
        for k, g in _grads(policy, draft).items():
            assert torch.equal(g, plain[1][k]), k
        policy.zero_grad(set_to_none=True)
        loss_rl, _ = cotrain_loss(policy, None, one[0].batch, adv, **kw)
        loss_rl.backward()
        ref = _grads(policy)
        for m in (2, 4):
            policy.zero_grad(set_to_none=True)
            mbs = split_microbatches(prompts, completions, logprobs, adv, 2, m, "cpu")
            loss_m, _ = pipeline_cotrain(pipe, policy, None, mbs, step=0, **kw)
            assert _rel(float(loss_m), float(loss_rl.detach())) < 1e-6, (norm, m)
            for k, g in _grads(policy).items():
                assert _rel(g, ref[k]) < 1e-5, (norm, m, k)


def test_schedule_and_split():
    assert [list(r) for r in stage_layers(30, 4)] == [list(range(0, 8)), list(range(8, 16)),
                                                      list(range(16, 23)), list(range(23, 30))]
    with pytest.raises(PipelineError, match="between 1 and 4"):
        stage_layers(4, 5)
    for stages in (1, 2, 4):
        for m in (1, 2, 3, 6):
            for s in range(stages):
                ops = one_f_one_b(s, stages, m)
                # every micro-batch forward once then backward once; at most stages - s in flight
                assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
                live, peak = set(), 0
                for op, i in ops:
                    if op == "F":
                        live.add(i)
                    else:
                        assert i in live
                        live.remove(i)
                    peak = max(peak, len(live))
                assert peak == min(stages - s, m)
    assert one_f_one_b(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert one_f_one_b(1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


def _weights_after_sync(rank, world):
    mesh = build_mesh(Layout(pp=world, cp=1), timeout=60)
    policy, draft = _models("eagle3")
    pipe = build_pipeline(policy, draft, mesh, max_tokens=64, timeout=60)
    with torch.no_grad():  # each stage changes what it owns; after the sync every rank has every change
        for p in stage_parameters(policy, mesh.stage, mesh.pp, tied_once=True):
            p.add_(1.0 + mesh.stage)
        if pipe.last:
            for p in draft.trainable_parameters():
                p.add_(10.0)
    sync_stage_weights(pipe, policy, list(draft.trainable_parameters()))
    if pipe.channel is not None:
        pipe.channel.close()
    return {n: p.detach().clone() for n, p in policy.named_parameters()}, \
        [p.detach().clone() for p in draft.trainable_parameters()]


def test_weight_sync_gives_every_rank_every_stage():
    res = run_ranks(_weights_after_sync, 4, timeout=120)
    policy, draft = _models("eagle3")
    expect = {}
    for s in range(4):
        for p in stage_parameters(policy, s, 4, tied_once=True):
            expect[id(p)] = 1.0 + s
    for rank, (weights, dweights) in enumerate(res):
        for n, p in policy.named_parameters():
            assert torch.equal(weights[n], p.detach() + expect[id(p)]), (rank, n)
        for got, p in zip(dweights, draft.trainable_parameters()):
            assert torch.equal(got, p.detach() + 10.0), rank


def _posted_batches(rank, world):
    """The stage-to-stage batches one step posts, as [(op, peer stage), ...] per batch."""
    import torch.distributed as dist
    mesh = build_mesh(Layout(pp=world, cp=1), timeout=60)
    posted, real = [], dist.batch_isend_irecv

    def record(ops):
        posted.append([(op.op.__name__, op.peer) for op in ops])
        return real(ops)
    dist.batch_isend_irecv = record
    try:
        _step("dflash", mesh, "shm", 4)
    finally:
        dist.batch_isend_irecv = real
    return posted


def test_steady_state_sends_go_with_the_receive_from_the_same_peer():
    """On NCCL a pair of stages shares one stream, so in 1F1B's steady state, where stage s sends
    activations to s + 1 while s + 1 sends gradients to s, two lone sends can wait on each other. Each
    such send is posted in one batch with the receive it faces (Megatron's send-forward-receive-backward
    and send-backward-receive-forward); warm-up and cool-down sends go alone. PP 2, 4 micro-batches."""
    first, last = run_ranks(_posted_batches, 2, timeout=120)
    send, recv = "isend", "irecv"
    # stage 0: F0 | F1 B0 | F2 B1 | F3 B2 | B3
    assert first == [[(send, 1)], [(send, 1), (recv, 1)], [(send, 1), (recv, 1)], [(send, 1), (recv, 1)],
                     [(recv, 1)]]
    # stage 1: F0 B0 | F1 B1 | F2 B2 | F3 B3
    assert last == [[(recv, 0)], [(send, 0), (recv, 0)], [(send, 0), (recv, 0)], [(send, 0), (recv, 0)],
                    [(send, 0)]]
