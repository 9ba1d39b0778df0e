"""A step's gradients and weights once its backward has run, at every layout.

* ``sync_gradients``: the sum of each parameter's gradient shares over a group (context parallelism: each CP
  rank's rows gave a share; the same TP shard on each);
* ``clip_grad_norm``: clipping by the global norm over plain tensors and DTensor shards together;
  ``torch.nn.utils.clip_grad_norm_`` runs one fused norm over all gradients, which refuses plain tensors next
  to DTensors (tensor parallelism leaves the norms plain) and DTensors of different meshes (FSDP over dp: a
  plain-born parameter's mesh is dp's, a tensor-parallel one's dp × tp). Here each kind is normed on its own: a
  DTensor group's norm reduced over its mesh (``full_tensor``), a plain tensor counted once, the squares added;
* under pipeline stages (``Pipeline``): ``reduce_stage_gradients`` (the DP and CP shares, the tied
  embedding's two stage shares), ``clip_stage_gradients`` (the global norms over the stages, the tied weight
  counted once, the TP shards' squares summed over tp), ``sync_stage_weights`` (every stage's update to every
  rank, among the ranks of one TP rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from codraft.parallel.comm import Group
from codraft.parallel.data_parallel import local
from codraft.parallel.mesh import Mesh
from codraft.parallel.pipeline import PipelineError, stage_parameters
from codraft.parallel.stages import Pipeline
from codraft.parallel.tp import split_over_tp


def sync_gradients(params, comm: Group, what: str) -> None:
    """Sum every parameter's gradient over ``comm`` (missing gradients count as zero)."""
    params = [p for p in params if p.requires_grad]
    if comm.size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [local(p.grad) for p in params]  # (tensor parallelism: this rank's shard, the same one over cp)
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    comm.all_reduce(flat, f"{what} gradients")
    o = 0
    for g in grads:
        g.copy_(flat[o:o + g.numel()].view_as(g))
        o += g.numel()


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``; returns the norm
    before clipping (a plain 0-dim tensor, the same on every rank). Collective over the DTensors' meshes."""
    groups: dict = {}  # the DTensors' meshes (None: plain tensors) -> the parameters with gradients
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def reduce_stage_gradients(pipe: Pipeline, policy, draft_params: list) -> tuple[list, list]:
    """Sum the DP and CP ranks' shares (FSDP has, where it shards the stages) and the tied weight's two stage
    shares (shard by shard); returns (policy params, draft params) this rank owns, every one with a gradient
    (zeros where its micro-batches gave none)."""
    mesh = pipe.mesh
    own = stage_parameters(policy, pipe.stage, pipe.stages)
    drafts = draft_params if pipe.last else []
    for p in own + drafts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    shares = None if mesh is None else mesh.data_group or mesh.cp_group  # the ranks of a stage: dp (× cp), or cp
    if shares is not None and not pipe.sharded:
        sync_gradients(own, shares, "policy")
        sync_gradients(drafts, shares, "draft")
    tied = policy.lm_head is None
    if pipe.stages > 1 and tied and (pipe.stage == 0 or pipe.last):
        g = local(policy.embed_tokens.weight.grad)
        try:
            dist.all_reduce(g, group=mesh.embedding)
        except RuntimeError as e:
            raise PipelineError(f"{mesh.where()}: summing the tied embedding's gradient with the other end of "
                                f"the pipeline failed: {e}") from e
    return own, drafts


def clip_stage_gradients(pipe: Pipeline, policy, own: list, drafts: list, max_policy: float,
                         max_draft: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip by the global norms (over all stages; the tied weight counted once) -> the two norms."""
    tied_twice = pipe.stages > 1 and pipe.last and policy.lm_head is None
    # on the gradients' device: an NCCL group reduces device tensors only; [policy, draft, policy's TP shards]
    sq = torch.zeros(3, dtype=torch.float64, device=local(own[0].grad).device)
    for p in own:
        if not (tied_twice and p is policy.embed_tokens.weight):
            sq[2 if split_over_tp(p.grad) else 0] += local(p.grad).detach().double().pow(2).sum()
    for p in drafts:
        sq[1] += local(p.grad).detach().double().pow(2).sum()
    if pipe.sharded:  # the shards' squares: summed over the stage's data ranks
        pipe.mesh.data_group.all_reduce(sq, "the gradient norms' shards")
    if pipe.mesh is not None and pipe.mesh.tp > 1:  # the tensor-parallel shards' squares: summed over tp
        try:
            dist.all_reduce(sq[2:], group=pipe.mesh.tp_mesh.get_group())
        except RuntimeError as e:
            raise PipelineError(f"{pipe.mesh.where()}: summing the gradient norms over the tensor-parallel ranks "
                                f"failed: {e}") from e
    sq = torch.stack([sq[0] + sq[2], sq[1]])
    if pipe.stages > 1:
        try:
            dist.all_reduce(sq, group=pipe.mesh.pp_group)
        except RuntimeError as e:
            raise PipelineError(f"{pipe.mesh.where()}: summing the gradient norms over the pipeline's stages "
                                f"failed: {e}") from e
    norms = sq.sqrt().float()
    for params, norm, limit in ((own, norms[0], max_policy), (drafts, norms[1], max_draft)):
        if limit is not None:
            coef = (limit / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                local(p.grad).mul_(coef.to(p.grad.dtype))
    return norms[0], None if max_draft is None else norms[1]


def sync_stage_weights(pipe: Pipeline, policy, draft_params: list) -> None:
    """After the update: every stage's parameters (and the draft, from the last stage) to every rank (sharded
    stages: the refit does, into the engine's copy)."""
    mesh = pipe.mesh
    if pipe.sharded:
        return
    for s in range(pipe.stages if pipe.stages > 1 else 0):  # (replicas agree after the DP sum: replica 0's)
        _broadcast(stage_parameters(policy, s, pipe.stages, tied_once=True), mesh.rank_of(s, dp_rank=0), mesh,
                   f"stage {s}'s weights")  # (tensor parallelism: each TP rank's shards among its own TP rank)
    if pipe.stages > 1:
        _broadcast(list(draft_params), mesh.rank_of(pipe.stages - 1, dp_rank=0), mesh, "the draft's weights")


def _broadcast(params: list, src: int, mesh: Mesh, what: str) -> None:
    if not params:
        return
    with torch.no_grad():
        shards = [local(p) for p in params]
        flat = torch.cat([t.detach().reshape(-1) for t in shards])
        try:
            dist.broadcast(flat, src, group=mesh.same_tp)
        except RuntimeError as e:
            raise PipelineError(f"{mesh.where()}: the weight sync of {what} from rank {src} failed: {e}") from e
        if mesh.world.rank != src:
            o = 0
            for t in shards:
                t.copy_(flat[o:o + t.numel()].view_as(t))
                o += t.numel()
