"""How a run is laid out over its ranks: ``Layout`` (the degrees) and ``Mesh`` (this rank's place and groups).

``Layout(dp, cp, pp, ..., tp)`` says how many ranks split the work each way (and how a step runs:
``sharded``, ``pipelined``); ``dp × cp × pp × tp`` must be the world
size (``Layout.check``). ``build_mesh`` builds one ``torch.distributed.device_mesh.DeviceMesh`` of shape
(pp, dp, cp, tp) with those dimension names (tp innermost: its ranks talk most, on one host's
fastest links), and every group and rank the run uses comes from it:

* ``world``: every rank (the rollout shards, the metrics);
* ``dp``: the ranks with the same stage, CP and TP rank (their prompt groups differ: the metrics of the
  update); ``data_group`` / ``data_mesh``: dp flattened with cp when CP is on, the ranks holding
  gradient shares of one parameter (FSDP's shards and gradient sum, torchtitan's ``dp_shard_cp``);
* ``cp``: the C ranks that split one packed row (the ring, the CP gradient sum);
* ``tp``: the ranks that split each product of the policy (``tp_mesh``: what ``codraft.parallel.tp``'s
  plans are applied over); ``same_tp``: the ranks holding the same shards (a stage's weight sync);
* ``pp``: the P stages of one (dp, cp) column (stage-to-stage activations; rank in it = stage);
* ``embedding``: stage 0 and stage P−1 of one column, which both hold the tied embedding / LM head
  weight and sum its two gradient shares (Megatron's embedding group): not a mesh dimension, so
  made with ``dist.new_group``, by every rank in one order.

A rank's coordinates and the rank at given coordinates are read from the DeviceMesh (row-major: global
rank = ((stage · D + d) · C + c) · T + t). Every group gets the world's timeout
(``parallel.timeout``), so a collective that waits on a dead or silent peer fails instead of hanging.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout  # (private; public in no release yet)

from codraft.parallel.layout import Layout
from codraft.parallel.comm import Group


@dataclass
class Mesh:
    layout: Layout
    device_mesh: DeviceMesh
    stage: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    world: Group
    dp_group: Group | None             # None when dp == 1
    data_mesh: DeviceMesh | None         # dp (× cp): None when dp == 1
    data_group: Group | None           # its group: None when dp == 1
    cp_group: Group | None             # None when cp == 1
    pp_group: dist.ProcessGroup | None   # None when pp == 1
    embedding: dist.ProcessGroup | None  # None when pp == 1
    tp_mesh: DeviceMesh | None           # None when tp == 1
    same_tp: dist.ProcessGroup | None    # the ranks with this TP rank (every stage, replica, CP rank): None when
    #                                      tp == 1 (the world); what a stage's weights are broadcast over

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def rank_of(self, stage: int, cp_rank: int = 0, dp_rank: int | None = None, tp_rank: int | None = None) -> int:
        """The global rank of (stage, cp_rank) in data-parallel replica ``dp_rank`` at TP rank ``tp_rank`` (None:
        this rank's)."""
        d = self.dp_rank if dp_rank is None else dp_rank
        return int(self.device_mesh.mesh[stage, d, cp_rank, self.tp_rank if tp_rank is None else tp_rank])

    def column(self, cp_rank: int, dp_rank: int | None = None, tp_rank: int | None = None) -> list[int]:
        """The global ranks of stages 0..P−1 at CP rank ``cp_rank`` of replica ``dp_rank`` and TP rank ``tp_rank``
        (None: this rank's)."""
        return [self.rank_of(s, cp_rank, dp_rank, tp_rank) for s in range(self.pp)]

    def where(self) -> str:
        dp = f", DP rank {self.dp_rank}/{self.dp}" if self.dp > 1 else ""
        tp = f", TP rank {self.tp_rank}/{self.tp}" if self.tp > 1 else ""
        return f"rank {self.world.rank} (pipeline stage {self.stage}/{self.pp}, CP rank {self.cp_rank}/{self.cp}" \
               f"{dp}{tp})"


def build_mesh(layout: Layout, device: str = "cpu", timeout: float = 300.0) -> Mesh:
    """This rank's place in the initialised world and its groups (see the module doc); collective."""
    world = Group.world(timeout)
    layout.check(world.size)
    dm = init_device_mesh(torch.device(device).type, (layout.pp, layout.dp, layout.cp, layout.tp),
                          mesh_dim_names=("pp", "dp", "cp", "tp"))
    stage, dp_rank, cp_rank, tp_rank = (dm.get_local_rank(n) for n in ("pp", "dp", "cp", "tp"))

    def group(name: str, size: int, rank: int) -> Group | None:
        return Group(dm.get_group(name), rank, size, timeout) if size > 1 else None

    data_mesh = data_group = None
    if layout.dp > 1:
        data_mesh = dm["dp"] if layout.cp == 1 else dm["dp", "cp"]._flatten("dp_cp")
        data_group = Group(data_mesh.get_group(), data_mesh.get_local_rank(), data_mesh.size(), timeout)
    td = datetime.timedelta(seconds=timeout)
    # the mesh's own groups are made with the backend's default timeout (30 min for gloo), not the world's;
    # FSDP and the pipeline use them directly, so a dead peer must surface after parallel.timeout there too
    same_tp = dm["pp", "dp", "cp"]._flatten("pp_dp_cp").get_group() if layout.tp > 1 else None
    for g in [dm.get_group(n) for n in ("pp", "dp", "cp", "tp")] + ([data_mesh.get_group()] if data_mesh else []) \
            + ([same_tp] if same_tp is not None else []):
        _set_pg_timeout(td, g)
    embedding = None
    if layout.pp > 1:  # every rank makes every pair, in one order (new_group is collective over the world)
        columns = dm.mesh.reshape(layout.pp, -1)  # a column: one (dp, cp, tp) coordinate's stages
        for column in range(columns.shape[1]):
            first, last = int(columns[0, column]), int(columns[-1, column])
            g = dist.new_group([first, last], timeout=td, group_desc=f"embedding-column{column}")
            if (columns[:, column] == world.rank).any():
                embedding = g
    mesh = Mesh(layout, dm, stage, dp_rank, cp_rank, tp_rank, world, group("dp", layout.dp, dp_rank), data_mesh,
                data_group, group("cp", layout.cp, cp_rank), dm.get_group("pp") if layout.pp > 1 else None,
                embedding, dm["tp"] if layout.tp > 1 else None, same_tp)
    for g in (world, mesh.dp_group, mesh.data_group, mesh.cp_group):  # their errors name this rank's place in the mesh
        if g is not None:
            g.where = mesh.where()
    # making the groups talks through rank 0's store; once every rank is past it, a rank that fails and exits
    # (rank 0 refusing the run folder) reaches its peers as an error of the next collective, which names it
    world.all_gather_object(None, "the device mesh (every rank's groups made)")
    return mesh
