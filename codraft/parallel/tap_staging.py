"""Host staging: the TapChannel baseline without pre-allocated slots.

Each tapped feature is pickled (stamp + tensor, through host memory) and sent with
``send_object_list`` to the last stage, which unpickles it into a fresh tensor; what a pipeline
would do without a side channel of its own besides relaying (``run_schedule(extra=)``). Same
interface as ``codraft.parallel.tapchannel`` (``put`` / ``get`` / ``close``), same stamp check;
the sends block, so a stage puts its taps after it has sent its activations.
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

    def put(self, step: int, microbatch: int, tap: int, tensor: torch.Tensor, timeout: float | None = None):
        item = ((step, microbatch, tap), tensor.detach().cpu())
        if self.stage == self.last:
            self.local[(step, microbatch, tap)] = item[1]
            return
        dist.send_object_list([item], dst=self.ranks[self.last], group=self.group)

    def get(self, step: int, microbatch: int, tap: int, timeout: float | None = None) -> torch.Tensor:
        want = (step, microbatch, tap)
        src = self.owner[tap]
        if src == self.stage:
            return self.local.pop(want)
        box = [None]
        try:
            dist.recv_object_list(box, src=self.ranks[src], group=self.group)
        except RuntimeError as e:
            raise TapTimeout(f"staging tap channel, stage {self.stage}: no tap {tap} of micro-batch {microbatch} "
                             f"(step {step}) from stage {src}: {e}") from e
        stamp, x = box[0]
        if stamp != want:
            raise TapStaleError(f"staging tap channel, stage {self.stage}: got (step, micro-batch, tap) {stamp} "
                                f"from stage {src}, expected {want}")
        return x.to(self.spec.device)

    def close(self):
        self.local.clear()


def open_staging_channel(spec: TapSpec, ranks: list[int]):
    """Collective over the world (a group of its own, gloo: the objects are host bytes)."""
    group = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=max(spec.timeout, 60.0)))
    return StagingTapChannel(spec, ranks, group) if dist.get_rank() in ranks else None
