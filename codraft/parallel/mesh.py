"""The process groups of a PP × CP run: which rank is which stage and CP rank, and who talks to whom.

Global rank = stage · C + c for P pipeline stages of C context-parallel ranks each. The groups:

* ``world``: every rank (the rollout shards, the metrics, the weight sync after each update);
* ``cp``: the C ranks of one stage (the ring, the CP gradient sum);
* ``pp``: the P ranks of one CP column (stage-to-stage activations; rank in it = stage);
* ``embedding``: stage 0 and stage P−1 of one column, which both hold the tied embedding / LM
  head weight and sum its two gradient shares (Megatron's embedding group);
* the TapChannel of the column is opened by the trainer (``open_tap_channel`` over ``columns``).

``dist.new_group`` is collective over the world: every rank creates every group, in one order.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from codraft.parallel.comm import CPGroup


@dataclass
class Mesh:
    pp: int
    cp: int
    stage: int
    cp_rank: int
    world: CPGroup
    cp_group: CPGroup | None        # None when cp == 1
    pp_group: dist.ProcessGroup | None  # None when pp == 1
    embedding: dist.ProcessGroup | None  # None when pp == 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, cp_rank: int = 0) -> int:
        return stage * self.cp + cp_rank

    def column(self, cp_rank: int) -> list[int]:
        """The global ranks of stages 0..P−1 at CP rank ``cp_rank``."""
        return [self.rank_of(s, cp_rank) for s in range(self.pp)]

    def where(self) -> str:
        return f"rank {self.world.rank} (pipeline stage {self.stage}/{self.pp}, CP rank {self.cp_rank}/{self.cp})"


def build_mesh(pp: int, cp: int, timeout: float = 300.0) -> Mesh:
    """Split the initialised world of P·C ranks into the groups above."""
    world = CPGroup.world(timeout)
    if world.size != pp * cp:
        raise ValueError(f"parallel.pp={pp} × parallel.cp={cp} needs {pp * cp} processes, got {world.size}")
    stage, cp_rank = divmod(world.rank, cp)
    td = datetime.timedelta(seconds=timeout)
    cp_group = pp_group = embedding = None
    # group_desc: NCCL's watchdog names the group of a collective that timed out
    for s in range(pp):  # every rank builds every group, in the same order
        g = dist.new_group([s * cp + c for c in range(cp)], timeout=td, group_desc=f"cp-stage{s}") if cp > 1 else None
        if s == stage and g is not None:
            cp_group = CPGroup(g, cp_rank, cp, timeout)
    if pp > 1:
        for c in range(cp):
            g = dist.new_group([s * cp + c for s in range(pp)], timeout=td, group_desc=f"pp-column{c}")
            e = dist.new_group([c, (pp - 1) * cp + c], timeout=td, group_desc=f"embedding-column{c}")
            if c == cp_rank:
                pp_group, embedding = g, e
    mesh = Mesh(pp, cp, stage, cp_rank, world, cp_group, pp_group, embedding)
    for group in (world, cp_group):  # their errors name this rank's place in the mesh
        if group is not None:
            group.where = mesh.where()
    return mesh
