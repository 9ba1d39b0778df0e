"""``parallelize``: the tensor- and data-parallel parts of a run's layout, applied to the plain policy and
draft from outside, once, after the models are built and before their optimisers, in this order:

1. the rollout engine's whole copies are made first (refreshed from the trainer's shards after every update);
2. **tensor parallelism** (``parallel.tp``): the policy's products split over ``mesh.tp_mesh`` by DTensor plans
   (``codraft.parallel.tp``);
3. **data parallelism** (``parallel.dp``): without pipeline stages, the policy (each decoder layer, then the
   root) and the co-trained draft wrapped by FSDP2 ``fully_shard`` (2-D with the tp split) or ``replicate``
   (``data_parallel``); with pipeline stages and ``fsdp``, each stage's own parameters sharded over the
   stage's data ranks and the other stages' freed (``sharded_stages``).
Nothing to do when the layout does not gather (one process, cp or pp alone, pp × dp with ``ddp``).

What it does not apply (elsewhere, each where its data is known):
- the **pipeline split** (``parallel.pp``): the stage's layers, the 1F1B schedule, its links and
  TapChannels are built on the first update (``codraft.parallel.stages.build_pipeline``: the channels are
  sized from a batch); with ``ddp`` each DP replica is a whole pipeline whose stage gradients are summed
  over the replicas there;
- **context parallelism** (``parallel.cp``): attention over the zigzag ring, installed per packed batch
  (``codraft.rl.cotrain.packed_row`` → ``codraft.parallel.context.ShardedRow``).
The update's forward and backward for the layout are chosen once (``codraft.rl.update_phase.step_body``).
"""
from __future__ import annotations

from codraft.parallel.data_parallel import parallelize_draft, parallelize_policy
from codraft.parallel.mesh import Layout, Mesh
from codraft.parallel.sharded_stages import StageRefit, shard_stage
from codraft.parallel.tp import parallelize_tp


def parallelize(policy, draft, layout: Layout, mesh: Mesh | None, rollout_weights, *, trains_draft: bool) -> None:
    """Apply ``layout``'s tensor and data parallelism to ``policy`` and ``draft`` in place (see the module doc)."""
    if not layout.gathers:
        return
    rollout_weights.draft_for(draft)  # the engine's whole copy of the draft, made before it is sharded
    if layout.tp > 1:  # first: FSDP then shards the tensor-parallel pieces over dp (2-D parameters)
        parallelize_tp(policy, mesh.tp_mesh, layout.sequence_parallel)
    if layout.sharded_stages:
        rollout_weights.refit = StageRefit(mesh, policy, draft, trains_draft=trains_draft)  # (names: before)
        shard_stage(policy, mesh)
    elif layout.sharded:
        parallelize_policy(policy, mesh, layout.dp_shard)
    if draft is not None:  # the target's parts, whole: the engine's refreshed copy
        draft.bind_target(*rollout_weights.target_parts())
    if trains_draft and (layout.sharded or layout.sharded_stages and mesh.last):  # (stages: the last trains it)
        parallelize_draft(draft, mesh, layout.dp_shard)
