"""Host staging: the TapChannel baseline without pre-allocated slots.

Each tapped feature is pickled (stamp + tensor, through host memory) and sent with
``send_object_list`` to the last stage, which unpickles it into a fresh tensor; what a pipeline
would do without a side channel of its own besides relaying (``run_schedule(extra=)``). Same
interface as ``codraft.parallel.tapchannel`` (``put`` / ``get`` / ``close``), same stamp check;
the sends block, so a stage puts its taps after it has sent its activations. Its waits are bounded by
the channel group's timeout (``max(spec.timeout, 60 s)``): ``send_object_list`` takes none of its own,
so ``put`` and ``get`` accept ``timeout`` for the interface only.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from codraft.parallel.tapchannel import TapSpec, TapStaleError, TapTimeout


class StagingTapChannel:
    transport = "staging"

    def __init__(self, spec: TapSpec, ranks: list[int], group):
        self.spec, self.ranks, self.group = spec, list(ranks), group
        self.stage = self.ranks.index(dist.get_rank())
        self.owner = {t: s for s, ts in enumerate(spec.taps) for t in ts}
        self.last = spec.stages - 1
        self.local: dict = {}  # the consumer's own taps

    def _who(self) -> str:
        return f"stage {self.stage} (rank {self.ranks[self.stage]})"

    def put(self, step: int, microbatch: int, tap: int, tensor: torch.Tensor, timeout: float | None = None):
        item = ((step, microbatch, tap), tensor.detach().cpu())
        if self.stage == self.last:
            self.local[(step, microbatch, tap)] = item[1]
            return
        try:
            dist.send_object_list([item], dst=self.ranks[self.last], group=self.group)
        except RuntimeError as e:
            raise TapTimeout(f"staging tap channel, {self._who()}: tap {tap} of micro-batch {microbatch} (step {step}) "
                             f"not taken by the last stage (rank {self.ranks[self.last]}): {e}") from e

    def get(self, step: int, microbatch: int, tap: int, timeout: float | None = None) -> torch.Tensor:
        want = (step, microbatch, tap)
        src = self.owner[tap]
        if src == self.stage:
            return self.local.pop(want).to(self.spec.device)
        box = [None]
        try:
            dist.recv_object_list(box, src=self.ranks[src], group=self.group)
        except RuntimeError as e:
            raise TapTimeout(f"staging tap channel, {self._who()}: no tap {tap} of micro-batch {microbatch} "
                             f"(step {step}) from stage {src} (rank {self.ranks[src]}): {e}") from e
        stamp, x = box[0]
        if stamp != want:
            raise TapStaleError(f"staging tap channel, {self._who()}: got (step, micro-batch, tap) {stamp} "
                                f"from stage {src}, expected {want}")
        return x.to(self.spec.device)

    def close(self):
        self.local.clear()


def open_staging_channel(spec: TapSpec, ranks: list[int]):
    """Collective over the world (a group of its own, gloo: the objects are host bytes)."""
    group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=max(spec.timeout, 60.0)),
                           group_desc=f"staging-{'-'.join(map(str, ranks))}")
    return StagingTapChannel(spec, ranks, group) if dist.get_rank() in ranks else None
