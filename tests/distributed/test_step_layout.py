"""A step draws the same at every layout (issue 46). The block drafts' anchors come from seeds of
(seed, step, the sequence's index in the step), not from the process's global RNG, which differs
between ranks (on the last stage after a rollout). So the PP = 2 step equals the single-process
step with no reseeding in between, and a sequence's anchors do not depend on the micro-batch split."""
from __future__ import annotations

import pytest
import torch

from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.rl.microbatch import split_microbatches
from codraft.parallel.stages import build_pipeline
from codraft.rl.pipelined import pipeline_cotrain
from codraft.train.seeding import sequence_seeds
from dist_harness import run_ranks
from test_cp_step import _models, _rel
from test_pp_step import LOSS_KW, _rollouts

SEED = 1618  # the step's seed (trainer: step_seed(cfg.seed, step))


def _draft_step(policy, draft, mesh, microbatches, seed=SEED):
    """The step's draft loss and this rank's draft gradients (the last stage's under PP)."""
    policy.zero_grad(set_to_none=True)
    draft.zero_grad(set_to_none=True)
    prompts, completions, logprobs, adv = _rollouts(3)
    mbs = split_microbatches(prompts, completions, logprobs, adv, 2, microbatches, "cpu")
    pipe = build_pipeline(policy, draft, mesh, max_tokens=1024, timeout=60)
    _, m = pipeline_cotrain(pipe, policy, draft, mbs, step=0, draft_seed=seed, **LOSS_KW)
    if pipe.channel is not None:
        pipe.channel.close()
    grads = {i: p.grad.clone() for i, p in enumerate(draft.trainable_parameters()) if p.grad is not None}
    return float(m["draft/loss"]), grads, {k: float(v) for k, v in m.items() if k.startswith("draft/")}


def _pp_vs_single(rank, world):
    mesh = build_mesh(Layout(pp=2, cp=1), timeout=60)
    out = {}
    for kind in ("dflash", "dspark"):
        policy, draft = _models(kind)
        for microbatches in (1, 2):
            ref = _draft_step(policy, draft, None, microbatches)
            torch.rand(1 + 5 * rank)  # the ranks' global RNGs now differ, as after a rollout
            out[(kind, microbatches)] = ref, _draft_step(policy, draft, mesh, microbatches)
    return out


def test_pp2_block_draft_step_equals_single_process_without_reseeding():
    for rank, res in enumerate(run_ranks(_pp_vs_single, 2, timeout=400)):
        for case, ((ref_loss, ref_grads, _), (loss, grads, _)) in res.items():
            assert _rel(loss, ref_loss) < 1e-6, (rank, case, loss, ref_loss)
            if rank == 1:  # the last stage trains the draft
                assert grads.keys() == ref_grads.keys() and grads, (case, grads.keys() ^ ref_grads.keys())
                for k, g in ref_grads.items():
                    assert _rel(grads[k], g) < 1e-5, (case, k, _rel(grads[k], g))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_microbatch_split_draws_the_same_anchors(kind):
    """Anchors as (sequence index in the step, position in the sequence), for M = 1, 2, 4 micro-batches."""
    policy, draft = _models(kind)
    seen, inner = [], draft.sample_anchors

    def record(batch, **kw):
        blocks = inner(batch, **kw)
        seq = torch.searchsorted(batch.cu_seqlens[1:], blocks.anchors, right=True)
        seen.append((batch.seeds[seq], blocks.pos))
        return blocks

    draft.sample_anchors = record

    def anchors(microbatches, seed=SEED):
        seen.clear()
        _draft_step(policy, draft, None, microbatches, seed)
        torch.rand(7)  # the global RNG moves between the steps: no effect
        # a sequence's index in the step, from its seed (the loss and its normaliser both draw anchors)
        index = {int(x): i for i, x in enumerate(sequence_seeds(seed, 0, 8))}
        return {(index[int(s)], int(p)) for seeds, pos in seen for s, p in zip(seeds, pos)}

    one = anchors(1)
    assert len({s for s, _ in one}) == 8  # every sequence of the step has anchors
    assert anchors(2) == one and anchors(4) == one
    assert anchors(1, SEED + 1) != one  # another step draws others


def _same_step(got, ref, what, rtol=1e-6):
    """The draft loss and every draft metric of two steps agree within ``rtol``, every draft gradient within
    2·rtol (fp32 rounding: the micro-batches sum their shares in another order)."""
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = got, ref
    assert _rel(loss, ref_loss) < rtol, (what, loss, ref_loss)
    assert metrics.keys() == ref_metrics.keys(), (what, metrics.keys() ^ ref_metrics.keys())
    bad = {k: (metrics[k], v) for k, v in ref_metrics.items() if not _rel(metrics[k], v) < rtol}
    assert not bad, (what, bad)
    assert grads.keys() == ref_grads.keys() and grads, (what, grads.keys() ^ ref_grads.keys())
    for k, g in ref_grads.items():
        assert _rel(grads[k], g) < 2 * rtol, (what, k, _rel(grads[k], g))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark", "model"])
def test_microbatched_draft_loss_is_the_one_batch_loss(kind):
    """M = 2 and 4 micro-batches (gradient accumulation, pp = 1): the draft loss, its metrics and its
    gradients are the one-batch step's, each micro-batch divided by the step's normaliser."""
    policy, draft = _models(kind)
    one = _draft_step(policy, draft, None, 1)
    for microbatches in (2, 4):
        _same_step(_draft_step(policy, draft, None, microbatches), one, (kind, microbatches))


def _pp_vs_one_batch(rank, world):
    mesh = build_mesh(Layout(pp=2, cp=1), timeout=60)
    out = {}
    for kind in ("dflash", "eagle3"):
        policy, draft = _models(kind)
        one = _draft_step(policy, draft, None, 1)
        torch.rand(1 + 5 * rank)
        out[kind] = one, _draft_step(policy, draft, mesh, 2)
    return out


def test_pp2_microbatched_draft_step_equals_the_one_batch_step():
    """PP = 2 with M = 2 micro-batches against the single-process step over one batch."""
    for rank, res in enumerate(run_ranks(_pp_vs_one_batch, 2, timeout=400)):
        for kind, (one, got) in res.items():
            if rank == 1:  # the last stage trains the draft
                _same_step(got, one, (rank, kind))
            else:
                assert _rel(got[0], one[0]) < 1e-6, (rank, kind, got[0], one[0])
