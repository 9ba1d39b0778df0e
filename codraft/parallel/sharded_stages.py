"""FSDP2 under pipeline stages: ``parallel.pp`` > 1 with ``parallel.dp`` > 1 and ``parallel.dp_shard=fsdp``.

A stage trains its own decoder layers (the first also the embedding; the last the final norm, the LM head
and the draft: ``pipeline.stage_parameters``). ``shard_stage`` shards exactly those over the stage's
data-parallel ranks (``Mesh.data_mesh``: dp, × cp when CP is on) with ``fully_shard``: each of its
decoder layers, then the policy's root with every other stage's parameters ignored — and those are freed,
so a trainer rank holds 1/dp of its stage and nothing of the others (torchtitan builds a stage as a model
with the other layers removed; here the modules stay, empty, so names and code paths are the plain
model's). The root's ``embed``, ``run_layers`` and ``logits`` are registered as forward methods: FSDP
gathers the embedding, norm and head around them, as the pipeline schedule calls them. The co-trained
draft is sharded over the last stage's data ranks.

The rollout engine decodes a whole copy (``RolloutWeights(gather=True)``, made before sharding), which
``StageRefit`` fills after every update: stage by stage, the stage's ranks gather their shards
(``full_tensor`` over the stage's data mesh, and its TP ranks) and the stage's first rank broadcasts them to
every rank in one flat fp32 buffer; then the draft from the last stage. ``StageRefit.whole`` gathers the same
way to rank 0 for the consolidated checkpoint.

The tied embedding / LM head: the first and the last stage both hold it, sharded the same way over data
meshes of one shape, so their two gradient shares are summed shard by shard (``gradients.reduce_stage_gradients``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import register_fsdp_forward_method

from codraft.models.layers import whole
from codraft.parallel.data_parallel import wrap
from codraft.parallel.mesh import Mesh
from codraft.parallel.pipeline import PipelineError, stage_layers, stage_parameters


def shard_stage(policy: nn.Module, mesh: Mesh) -> None:
    """Shard this stage's parameters over its data ranks and free the other stages' (see the module doc)."""
    mine = {id(p) for p in stage_parameters(policy, mesh.stage, mesh.pp)}
    others = {p for p in policy.parameters() if id(p) not in mine}
    for p in others:  # the engine's whole copy holds them; the trainer never runs them
        p.requires_grad_(False)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    layers = stage_layers(policy.config.num_hidden_layers, mesh.pp)[mesh.stage]
    wrap(policy, [policy.layers[i] for i in layers], mesh.data_mesh, "fsdp", ignored=others)
    for name in ("embed", "run_layers", "logits"):  # what the schedule calls instead of forward
        register_fsdp_forward_method(policy, name)


class StageRefit:
    """Fills a ``RolloutWeights``' whole copies from the stages' shards: collective over the world, every
    rank calls it after every update (``RolloutWeights.refresh``). Built before ``shard_stage``: it
    records each stage's parameter names and shapes from the whole model."""

    def __init__(self, mesh: Mesh, policy: nn.Module, draft, *, trains_draft: bool):
        self.mesh = mesh
        self.keys = list(policy.state_dict())  # the rollout copy's tensors, in this order
        names = {id(p): n for n, p in policy.named_parameters()}
        self.stages = [[names[id(p)] for p in stage_parameters(policy, s, mesh.pp, tied_once=True)]
                       for s in range(mesh.pp)]
        self.mine = {names[id(p)] for p in stage_parameters(policy, mesh.stage, mesh.pp)}  # (a tied head too)
        self.shapes = {n: p.shape for n, p in policy.named_parameters()}
        self.device = policy.embed_tokens.weight.device
        self.draft = draft if trains_draft else None
        if self.draft is not None:  # its tensors named "draft.<name>" here
            trained = {id(p) for p in draft.trainable_parameters()}
            self.draft_names = [f"draft.{n}" for n, p in draft.named_parameters() if id(p) in trained]
            self.shapes.update({f"draft.{n}": p.shape for n, p in draft.named_parameters()})
        self.embed = "embed_tokens.weight"
        self.head = "embed_tokens.weight" if policy.lm_head is None else "lm_head.weight"

    def held(self, draft, name: str) -> bool:
        """Whether this rank's trainer holds tensor ``name`` (of ``draft``; None: the policy) current."""
        return self.mesh.last if draft is not None else name in self.mine

    def _rounds(self, policy: nn.Module):
        """(name, whole fp32 tensor) of every trained tensor, the stages' in turn: every rank receives all."""
        m = self.mesh
        own = dict(policy.named_parameters())
        for s, names in enumerate(self.stages):
            yield from self._broadcast(names, own if m.stage == s else None, m.rank_of(s, dp_rank=0, tp_rank=0),
                                       f"stage {s}")
        if self.draft is not None:
            own = {f"draft.{n}": p for n, p in self.draft.named_parameters()} if m.last else None
            yield from self._broadcast(self.draft_names, own, m.rank_of(m.pp - 1, dp_rank=0, tp_rank=0), "the draft")

    def _broadcast(self, names: list[str], own: dict | None, src: int, what: str):
        shapes = [self.shapes[n] for n in names]
        with torch.no_grad():
            try:
                if own is not None:  # this stage's ranks: their shards gathered (over the stage's data mesh)
                    flat = torch.cat([whole(own[n]).reshape(-1).float() for n in names])
                else:
                    flat = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=self.device)
                dist.broadcast(flat, src)
            except RuntimeError as e:  # a peer of the stage (the gather) or rank src died or did not answer
                raise PipelineError(f"{self.mesh.where()}: the refit of {what}'s weights (gathered on its ranks, "
                                    f"sent from rank {src}) failed: {str(e).splitlines()[0]}") from e
        o = 0
        for n, shape in zip(names, shapes):
            yield n, flat[o:o + shape.numel()].view(shape)
            o += shape.numel()

    @torch.no_grad()
    def __call__(self, rw) -> None:
        """Refresh ``rw``'s policy copy, the fp32 target parts and the draft's copy."""
        dst = dict(zip(self.keys, rw.policy.state_dict().values()))
        rolling = rw.drafts[id(self.draft)][1].state_dict() if self.draft is not None else {}
        for name, t in self._rounds(rw.source):
            if name.startswith("draft."):
                rolling[name.removeprefix("draft.")].copy_(t)
                continue
            dst[name].copy_(t)
            for part, which in zip(rw.parts or (), (self.embed, self.head)):
                if name == which:
                    part.copy_(t)

    def whole(self, policy: nn.Module) -> tuple[dict, dict]:
        """The policy's and the draft's trained tensors, whole fp32, on rank 0 (empty elsewhere): collective."""
        keep = self.mesh.world.rank == 0
        weights, draft = {}, {}
        for name, t in self._rounds(policy):
            if keep:
                (draft if name.startswith("draft.") else weights)[name.removeprefix("draft.")] = t.clone()
        return weights, draft
