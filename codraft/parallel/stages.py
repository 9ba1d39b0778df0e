"""This rank's part of a pipeline (``parallel.pp``, or ``parallel.microbatches`` in one process): its decoder
layers, its links to the neighbouring stages and the TapChannel its taps travel on. Built on the first
update (``build_pipeline``: the channels are sized from that batch); the schedule that runs it is
``codraft.rl.pipelined.pipeline_cotrain``, what happens to its gradients and weights after the backward
``codraft.parallel.gradients``.
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
    channel: object = None

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


def build_pipeline(policy, draft, mesh: Mesh | None, *, transport: str = "shm", max_tokens: int = 0,
                   timeout: float = 300.0) -> Pipeline:
    """Collective over the world when ``mesh.pp`` > 1 (the tap channels' groups): every rank calls it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown tap transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    pp = 1 if mesh is None else mesh.pp
    bounds = stage_layers(policy.config.num_hidden_layers, pp)
    taps = tuple(draft.feature_layers) if draft is not None else ()
    stage_taps = tuple(tuple(sorted(t for t in taps if t in b)) for b in bounds)
    stage = 0 if mesh is None else mesh.stage
    link = StageLink(stage, pp, None if mesh is None else mesh.pp_group, timeout,
                     where="" if mesh is None else mesh.where())
    pipe = Pipeline(mesh, bounds[stage], transport, link)
    if pp > 1 and taps and transport != "relay":
        dev = str(policy.embed_tokens.weight.device)
        spec = TapSpec(max_tokens=max_tokens, hidden=policy.config.hidden_size, taps=stage_taps,
                       in_flight=pp, dtype=policy.embed_tokens.weight.dtype, timeout=timeout, device=dev)
        # one channel per column (replica, CP rank, TP rank: each TP rank's last stage reads the same taps, whole);
        # every rank takes part in making each
        for d, c, t in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
            column = mesh.column(c, d, t)
            ch = open_staging_channel(spec, column) if transport == "staging" \
                else open_tap_channel(spec, transport, column)
            if (d, c, t) == (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank):
                pipe.channel = ch
    return pipe
