"""One rank's stage of the co-training step over micro-batches (``parallel.pp``, ``parallel.microbatches``):
``run_stage`` runs it through the 1F1B schedule (``codraft.parallel.pipeline.run_schedule``).

Every rank's engine decodes with the whole policy and draft, but in the update a stage runs only its
own decoder layers (``stage_layers``; the first also embeds, the last also runs the head and the
objective's losses) and keeps gradients only for the parameters it owns; their sums, the clipping and the
weight sync after the optimiser step are ``codraft.parallel.gradients``'. With ``pp = 1`` the same code is
plain gradient accumulation over micro-batches. What the losses are is the caller's (``StageObjective``:
``codraft.rl.objective.CoTrainingLoss``).

The taps: a stage puts the taps among its layers on the TapChannel after it has sent its
activations; the last stage gets them before the draft loss of that micro-batch (``shm`` / ``p2p``,
or the baselines ``staging``: pickled through the host, and ``relay``: appended to the
activations inside the schedule). The schedule itself is the same with or without taps.
"""
from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from codraft.models.bf16 import products
from codraft.models.moe import Routing
from codraft.parallel.pipeline import PipelineError, run_schedule
from codraft.parallel.stages import Pipeline


class StageObjective(Protocol):
    """What the last stage computes from the policy's output, and what every stage needs to know of it."""
    taps: tuple[int, ...]        # the policy layers whose outputs the draft reads
    policy_dtype: torch.dtype    # the products of the policy's forward (``codraft.models.bf16``)

    def row(self, batch, cp):
        """A micro-batch as this rank runs it (a ``Row``: all of it, or under cp its zigzag rows)."""

    def hidden_loss(self, mb, row, hidden: torch.Tensor, feats: dict) -> tuple[torch.Tensor, dict]:
        """The micro-batch's loss and metrics from the policy's last hidden states and the taps."""


@contextlib.contextmanager
def _naming(pipe: Pipeline, what: str):
    """A tap transfer that fails (a dead or hung peer: the channel's timeout, or gloo's own error) is a
    ``PipelineError`` naming this stage, the tap and the micro-batch, as the activations' are."""
    try:
        yield
    except RuntimeError as e:
        raise PipelineError(f"{pipe.link.who}: {what}: {e}") from e


def run_stage(pipe: Pipeline, policy, trained_draft, objective: StageObjective, mbs: list, step: int
              ) -> tuple[torch.Tensor, list[dict]]:
    """Forward and backward of the step's micro-batches ``mbs`` on this stage (1F1B); gradients accumulate in
    the parameters this stage runs (``trained_draft``: the co-trained draft, or None). Returns the step's loss
    and each micro-batch's metrics, on every rank."""
    mesh, last = pipe.mesh, pipe.last
    taps = objective.taps
    mine = tuple(t for t in taps if t in pipe.layers)
    before = [t for t in taps if t < pipe.layers.start]  # relay: what arrives with the activations
    rows = [objective.row(mb.batch, None if mesh is None else mesh.cp_group) for mb in mbs]
    inputs = [row.model_inputs() for row in rows]
    hidden_size = policy.config.hidden_size
    relay = pipe.transport == "relay"
    tapped, parts = {}, [None] * len(mbs)

    def forward(m, x, carried):
        ids, kw = inputs[m]
        ctx = policy.layer_inputs(1, ids.shape[1], ids.device, **kw)
        replay = mbs[m].replay  # routing replay: this stage's MoE layers route as the rollout did
        with products(objective.policy_dtype), contextlib.nullcontext() if replay is None else \
                Routing(policy, rows[m].local(replay)):
            out, tapped[m] = policy.run_layers(policy.embed(ids) if x is None else x, ctx, pipe.layers, mine)
        if last or not relay:
            return out, carried
        cols = ([] if carried is None else [carried]) + [tapped[m][t].detach() for t in mine]
        return out, torch.cat(cols, -1) if cols else None

    def after_forward(m):
        own = tapped.pop(m)
        if pipe.channel is not None:
            for t in mine:
                with _naming(pipe, f"cannot send tap {t} of micro-batch {m} to the last stage"):
                    pipe.channel.put(step, m, t, own[t][0])

    def loss(m, hidden, carried):
        own = tapped.pop(m, {})
        feats = {}
        for t in taps:
            if t in own:
                feats[t] = own[t]
            elif relay:
                i = before.index(t)
                feats[t] = carried[..., i * hidden_size:(i + 1) * hidden_size]
            else:
                with _naming(pipe, f"no tap {t} of micro-batch {m}"):
                    feats[t] = pipe.channel.get(step, m, t)[None]
        out, parts[m] = objective.hidden_loss(mbs[m], rows[m], hidden, feats)
        return out

    sharded = [policy] + ([trained_draft] if last and trained_draft is not None else [])

    def before_backward(final):  # sharded stages: FSDP sums the stage's gradients after its last backward only
        for module in sharded:
            module.set_requires_gradient_sync(final)

    w = policy.embed_tokens.weight
    losses = run_schedule(pipe.link, len(mbs), forward=forward, loss=loss,
                          shape=lambda m: (1, inputs[m][0].shape[1], hidden_size), dtype=w.dtype, device=w.device,
                          extra=hidden_size * len(before) if relay else 0,
                          after_forward=None if last else after_forward,
                          before_backward=before_backward if pipe.sharded else None)
    result = (torch.stack(losses).sum(), parts) if last else None
    if pipe.stages > 1:  # the last stage's loss and metrics, to every rank
        shared = mesh.world.all_gather_object(result, "the step's loss and metrics")
        result = shared[mesh.rank_of(pipe.stages - 1)]
    return result
