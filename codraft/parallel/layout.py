"""How many ranks split a run's work each way: ``Layout`` (dp, cp, pp, tp, micro-batches, how FSDP shards) and
what follows from the degrees alone (the world size, whether a step is sharded or pipelined, whether the
rollout engine decodes a gathered copy). The one place the degrees are multiplied: the config's rules read it,
and ``codraft.parallel.mesh.build_mesh`` lays the ranks out by it.
"""
from __future__ import annotations

from dataclasses import dataclass

from codraft.errors import CodraftError


class LayoutError(CodraftError, ValueError):
    """A layout that does not fit the processes started."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    cp: int = 1
    pp: int = 1
    microbatches: int = 1   # per DP rank
    dp_shard: str = "fsdp"  # fsdp or ddp
    tp: int = 1
    sequence_parallel: bool = False  # under tp: the residual stream split along the sequence too

    @classmethod
    def of(cls, parallel) -> "Layout":
        """From the run config's ``parallel`` section."""
        return cls(parallel.dp, parallel.cp, parallel.pp, parallel.microbatches, parallel.dp_shard, parallel.tp,
                   parallel.sequence_parallel)

    @property
    def sharded(self) -> bool:
        """The policy and draft wrapped by FSDP2 (``codraft.parallel.parallelize``): dp without stages."""
        return self.dp > 1 and self.pp == 1

    @property
    def sharded_stages(self) -> bool:
        """Pipeline stages whose parameters FSDP2 shards over their data ranks (``codraft.parallel.sharded_stages``)."""
        return self.dp > 1 and self.pp > 1 and self.dp_shard == "fsdp"

    @property
    def gathers(self) -> bool:
        """The rollout engine decodes a whole copy gathered from the trainer's shards after every update."""
        return self.sharded or self.sharded_stages or self.tp > 1

    @property
    def pipelined(self) -> bool:
        """The step runs the 1F1B schedule: stages, or micro-batches without FSDP (which accumulates them)."""
        return self.pp > 1 or (self.microbatches > 1 and not self.sharded)

    @property
    def splits_batch(self) -> bool:
        """A step's batch runs in pieces (ranks' groups or rows, stages, micro-batches), not as one forward."""
        return self.dp > 1 or self.cp > 1 or self.pp > 1 or self.microbatches > 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    def keys(self) -> str:
        """The keys as a user writes them, those > 1 only (for messages)."""
        return " ".join(f"parallel.{k}={n}" for k, n in (("dp", self.dp), ("pp", self.pp), ("cp", self.cp),
                                                                ("tp", self.tp))
                        if n > 1)

    def check(self, world: int) -> None:
        if world != self.world:
            raise LayoutError(f"parallel.dp={self.dp} × parallel.pp={self.pp} × parallel.cp={self.cp} × "
                              f"parallel.tp={self.tp} = {self.world} ranks, but torchrun started {world} processes; "
                              f"launch with torchrun --nproc-per-node {self.world}")
