"""``parallelize``: a run's whole layout applied to the plain policy and draft from outside, once, after the
models are built and before their optimisers, in this order:

1. the rollout engine's whole copies are made first, where the layout splits the weights (refreshed from the
   trainer's shards after every update);
2. **tensor parallelism** (``parallel.tp``): the policy's products split over ``mesh.tp_mesh`` by DTensor plans
   (``codraft.parallel.tp``);
3. **context parallelism** (``parallel.cp``): the update step gets the CP group; it runs each packed batch on
   this rank's zigzag rows, whose ring attention is installed per batch (``codraft.parallel.context``: the
   split follows the batch's sequences), and sums the gradient shares over cp;
4. the **pipeline split** (``parallel.pp``, or micro-batches without FSDP): this rank's stage (its layers and
   its links, ``codraft.parallel.stages.split_pipeline``); its tap channels are opened on the first update,
   sized from that batch;
5. **data parallelism** (``parallel.dp``): without stages, the policy (each decoder layer, then the root) and
   the co-trained draft wrapped by FSDP2 ``fully_shard`` (2-D with the tp split) or ``replicate``
   (``data_parallel``); with stages and ``fsdp``, each stage's own parameters sharded over the stage's data
   ranks and the other stages' freed (``sharded_stages``); with stages and ``ddp``, each replica a whole
   pipeline whose gradients the step sums over the replicas.

It returns the update's machinery for the layout (``codraft.parallel.step.TrainStep``: the one-batch,
data-parallel or pipelined body, with its gradient sums, clipping and weight sync), chosen here once.
"""
from __future__ import annotations

from codraft.parallel.layout import Layout
from codraft.parallel.data_parallel import parallelize_draft, parallelize_policy
from codraft.parallel.mesh import Mesh
from codraft.parallel.sharded_stages import StageRefit, shard_stage
from codraft.parallel.step import DataParallel, OneBatch, Pipelined, TrainStep
from codraft.parallel.tp import parallelize_tp


def parallelize(policy, draft, mesh: Mesh | None, cfg, rollout_weights, *, trains_draft: bool) -> TrainStep:
    """Apply the layout of ``cfg`` (the run's ``RunConfig``) to ``policy`` and ``draft`` in place (see the module
    doc); returns the update's machinery for it."""
    layout = Layout.of(cfg.parallel)
    if layout.gathers:
        rollout_weights.draft_for(draft)  # the engine's whole copy of the draft, made before it is sharded
    if layout.tp > 1:  # first: FSDP then shards the tensor-parallel pieces over dp (2-D parameters)
        parallelize_tp(policy, mesh.tp_mesh, layout.sequence_parallel)
    kw = dict(trains_draft=trains_draft, grad_clip=cfg.grpo.grad_clip, draft_clip=cfg.draft.grad_clip)
    if layout.pipelined:
        step = Pipelined(policy, draft, mesh, par=cfg.parallel, rollout=cfg.rollout, **kw)
    elif layout.sharded:
        step = DataParallel(policy, draft, mesh, microbatches=layout.microbatches, **kw)
    else:
        step = OneBatch(policy, draft, mesh, **kw)
    if layout.sharded_stages:
        rollout_weights.refit = StageRefit(mesh, policy, draft, trains_draft=trains_draft)  # (names: before)
        shard_stage(policy, mesh)
    elif layout.sharded:
        parallelize_policy(policy, mesh, layout.dp_shard)
    if draft is not None and layout.gathers:  # the target's parts, whole: the engine's refreshed copy
        draft.bind_target(*rollout_weights.target_parts())
    if trains_draft and (layout.sharded or layout.sharded_stages and mesh.last):
        parallelize_draft(draft, mesh, layout.dp_shard)  # (stages: the last trains it)
    return step
