"""The co-training step over a pipeline's stage, given its micro-batches: ``pipeline_cotrain`` (what the tests
and the tap benchmark run directly; the trainer's ``codraft.parallel.step.Pipelined`` calls
``codraft.parallel.pipelined.run_stage`` with the step's objective)."""
from __future__ import annotations

import torch

from codraft.parallel.pipelined import run_stage
from codraft.parallel.stages import Pipeline
from codraft.rl.microbatch import MicroBatch, merge_metrics, with_draft_normaliser
from codraft.rl.objective import CoTrainingLoss


def pipeline_cotrain(pipe: Pipeline, policy, draft, mbs: list[MicroBatch], *, step: int, train_draft: bool = True,
                     policy_dtype: torch.dtype = torch.float32, merged: bool = True, **loss_kw
                     ) -> tuple[torch.Tensor, dict | list[dict]]:
    """Forward and backward of the step's micro-batches on this stage (1F1B); gradients accumulate in
    the parameters this stage runs. Returns the step's loss and metrics (``merged=False``: each
    micro-batch's), on every rank."""
    if len(mbs) > 1 and draft is not None and train_draft and mbs[0].totals.draft_norm is None:
        # the draft loss's denominators: the step's (given already when these are a share of the step); on every
        # stage, which merges the metrics by them
        mbs = with_draft_normaliser(mbs, draft, loss_kw.get("draft_seed"))
    objective = CoTrainingLoss(policy, draft, dict(loss_kw, train_draft=train_draft, policy_dtype=policy_dtype))
    loss, parts = run_stage(pipe, policy, draft if train_draft else None, objective, mbs, step)
    return loss, merge_metrics(parts, mbs) if merged else parts
