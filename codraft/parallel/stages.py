"""This rank's part of a pipeline (``parallel.pp``, or ``parallel.microbatches`` in one process): its decoder
layers, its links to the neighbouring stages (``split_pipeline``, when the layout is applied) and the
TapChannel its taps travel on (``open_channel``, on the first update: sized from that batch). What runs it
through the schedule is ``codraft.parallel.pipelined.run_stage``, what happens to its gradients and weights
after the backward ``codraft.parallel.gradients``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from codraft.parallel.mesh import Mesh
from codraft.parallel.pipeline import StageLink, stage_layers
from codraft.parallel.tap_staging import open_staging_channel
from codraft.parallel.tapchannel import TapSpec, open_tap_channel

TRANSPORTS = ("shm", "p2p", "staging", "relay")


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its layers, its link to the neighbours, the tap channel."""
    mesh: Mesh | None
    layers: range
    transport: str
    link: StageLink
    taps: tuple = ()      # each stage's tapped layers (the draft's feature layers among them)
    channel: object = None  # the tap channel: opened on the first update (``open_channel``)

    @property
    def stage(self) -> int:
        return 0 if self.mesh is None else self.mesh.stage

    @property
    def stages(self) -> int:
        return 1 if self.mesh is None else self.mesh.pp

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def sharded(self) -> bool:
        """Each stage's parameters sharded over its data ranks by FSDP2 (``codraft.parallel.sharded_stages``)."""
        return self.mesh is not None and self.mesh.layout.sharded_stages


def split_pipeline(policy, draft, mesh: Mesh | None, *, transport: str = "shm", timeout: float = 300.0) -> Pipeline:
    """This rank's stage of the policy (its layers and its link to the neighbours; not collective). Its tap
    channel is opened on the first update (``open_channel``), sized from that batch."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown tap transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    pp = 1 if mesh is None else mesh.pp
    bounds = stage_layers(policy.config.num_hidden_layers, pp)
    taps = tuple(draft.feature_layers) if draft is not None else ()
    stage = 0 if mesh is None else mesh.stage
    link = StageLink(stage, pp, None if mesh is None else mesh.pp_group, timeout,
                     where="" if mesh is None else mesh.where())
    return Pipeline(mesh, bounds[stage], transport, link, taps=tuple(tuple(sorted(t for t in taps if t in b))
                                                                     for b in bounds))


def open_channel(pipe: Pipeline, policy, max_tokens: int) -> None:
    """The tap channels of a pipeline whose stages hold taps (not ``relay``: those travel with the activations),
    ``max_tokens`` slots each; collective over the world (every rank takes part in making each)."""
    if pipe.stages == 1 or not any(pipe.taps) or pipe.transport == "relay":
        return
    mesh, w = pipe.mesh, policy.embed_tokens.weight
    spec = TapSpec(max_tokens=max_tokens, hidden=policy.config.hidden_size, taps=pipe.taps, in_flight=pipe.stages,
                   dtype=w.dtype, timeout=pipe.link.timeout, device=str(w.device))
    # one channel per column (replica, CP rank, TP rank: each TP rank's last stage reads the same taps, whole)
    for d, c, t in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
        column = mesh.column(c, d, t)
        ch = open_staging_channel(spec, column) if pipe.transport == "staging" \
            else open_tap_channel(spec, pipe.transport, column)
        if (d, c, t) == (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank):
            pipe.channel = ch


def build_pipeline(policy, draft, mesh: Mesh | None, *, transport: str = "shm", max_tokens: int = 0,
                   timeout: float = 300.0) -> Pipeline:
    """``split_pipeline`` and ``open_channel`` at once; collective over the world when ``mesh.pp`` > 1."""
    pipe = split_pipeline(policy, draft, mesh, transport=transport, timeout=timeout)
    open_channel(pipe, policy, max_tokens)
    return pipe
