"""Pipeline faults fail loudly and in bounded time, naming the stage and micro-batch: a stage that
hangs, a stage that dies (before the step, or after its forwards), for both neighbours."""
from __future__ import annotations

import os
import re
import time

import pytest

from codraft.parallel.layout import Layout
from codraft.parallel.mesh import build_mesh
from codraft.parallel.pipeline import PipelineError
from codraft.rl.microbatch import split_microbatches
from codraft.parallel.stages import build_pipeline
from codraft.rl.pipelined import pipeline_cotrain
from dist_harness import run_ranks
from test_cp_step import _models
from test_pp_step import LOSS_KW, _rollouts

TIMEOUT = 3.0


def _faulty_stage(rank, world, victim, fault):
    mesh = build_mesh(Layout(pp=world, cp=1), timeout=TIMEOUT)
    policy, draft = _models("eagle3")
    pipe = build_pipeline(policy, draft, mesh, transport="p2p", max_tokens=1024, timeout=TIMEOUT)
    prompts, completions, logprobs, adv = _rollouts(3)
    mbs = split_microbatches(prompts, completions, logprobs, adv, 2, 2, "cpu")
    if rank == victim:
        if fault == "dead":
            os._exit(3)
        time.sleep(4 * TIMEOUT)
        return "idle"
    t0 = time.monotonic()
    try:
        pipeline_cotrain(pipe, policy, draft, mbs, step=0, **LOSS_KW)
    except (PipelineError, RuntimeError) as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


@pytest.mark.parametrize("victim,fault,expect", [
    (1, "silent", r"^rank 0 \(pipeline stage 0/2, CP rank 0/1\): no gradients of micro-batch 0 from stage 1"),
    (0, "silent", r"^rank 1 \(pipeline stage 1/2, CP rank 0/1\): no activations of micro-batch 0 from stage 0"),
    # a dead peer may already refuse the send of the first micro-batch's activations, or of its taps
    (1, "dead", r"^rank 0 \(pipeline stage 0/2, CP rank 0/1\): (no gradients of micro-batch 0 from stage 1|cannot "
                r"send the activations of micro-batch [01] to stage 1|cannot send tap \d+ of micro-batch [01] to the "
                r"last stage)"),
    (0, "dead", r"^rank 1 \(pipeline stage 1/2, CP rank 0/1\): no activations of micro-batch 0 from stage 0"),
])
def test_a_stage_that_hangs_or_dies_is_named(victim, fault, expect):
    results, errors = run_ranks(_faulty_stage, 2, victim, fault, expect_failure=True, timeout=90)
    survivor = 1 - victim
    assert survivor not in errors, errors
    kind, message, seconds = results[survivor]
    assert kind == "PipelineError" and re.search(expect, message), (kind, message)
    assert seconds < 4 * TIMEOUT
