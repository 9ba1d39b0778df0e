"""Pipeline parallelism: the layer split, the 1F1B schedule and the stage-to-stage sends.

A policy of L decoder layers runs as P stages (``stage_layers``): stage 0 also embeds the
tokens, the last stage also runs the final norm, the LM head and the losses (RL and draft). A
step's batch is cut into M micro-batches, and every stage runs the one-forward-one-backward
schedule (``one_f_one_b``): P − 1 − s forwards to fill the pipe, then alternating forward and
backward, then the remaining backwards. Activations go forward and their gradients backward
between adjacent stages only (``StageLink``); what the draft needs from earlier stages (the
taps) travels outside this schedule, on a ``TapChannel`` — or, as the *relay* baseline, appended
to the activations (``run_schedule`` carries ``extra`` columns forward and no gradient back).

Every stage knows every micro-batch's shape (all ranks hold the same batch), so a receive needs
no shape message. Every receive waits at most ``timeout`` seconds, then raises ``PipelineError``
naming this stage, the peer stage, the micro-batch and the direction. Sends are ``isend``s
completed at the end of the schedule (one outstanding send per direction and micro-batch).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from codraft.parallel.comm import time_left


class PipelineError(RuntimeError):
    """A pipeline peer did not deliver in time (or died), or the split is impossible."""


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Balanced contiguous split of the decoder layers; the spare layers go to the earlier stages
    (the last one also runs the head and both losses)."""
    if not 1 <= stages <= num_layers:
        raise PipelineError(f"cannot split {num_layers} decoder layers into {stages} pipeline stages "
                            f"(parallel.pp must be between 1 and {num_layers})")
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of stage ``stage``: [("F", m) | ("B", m), ...] over M micro-batches."""
    warm = min(stages - 1 - stage, microbatches)
    ops = [("F", m) for m in range(warm)]
    f, b = warm, 0
    while f < microbatches:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    ops += [("B", m) for m in range(b, microbatches)]
    return ops


@dataclass
class StageLink:
    """Point-to-point sends between adjacent stages, on the pipeline's own process group
    (``group``: the ranks of stage 0..P−1 in order; None = the world, rank = stage)."""
    stage: int
    stages: int
    group: dist.ProcessGroup | None = None
    timeout: float = 300.0
    where: str = ""  # this rank in a PP × CP mesh (``Mesh.where``), for the errors; else its stage
    _sends: list = field(default_factory=list)

    @property
    def who(self) -> str:
        return self.where or f"pipeline stage {self.stage}/{self.stages}"

    def _rank(self, stage: int) -> int:
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def _send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        x = x.contiguous()
        try:
            work = dist.isend(x, self._rank(dst), group=self.group, tag=tag)
        except RuntimeError as e:
            raise PipelineError(f"{self.who}: cannot send the {_what(tag)} of "
                                f"micro-batch {tag // 2} to stage {dst} (stage {dst} died?): {e}") from e
        self._sends.append((work, x, dst, tag))

    def _recv(self, shape, dtype, device, src: int, tag: int, what: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        work = dist.irecv(buf, self._rank(src), group=self.group, tag=tag)
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise PipelineError(f"{self.who}: no {what} from stage {src} within "
                                f"{self.timeout:g} s (stage {src} died or hangs): {e}") from e
        if ok is False:
            raise PipelineError(f"{self.who}: no {what} from stage {src} within "
                                f"{self.timeout:g} s")
        return buf

    def send_forward(self, x: torch.Tensor, microbatch: int) -> None:
        self._send(x, self.stage + 1, 2 * microbatch)

    def recv_forward(self, shape, dtype, device, microbatch: int) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.stage - 1, 2 * microbatch,
                          f"activations of micro-batch {microbatch}")

    def send_backward(self, g: torch.Tensor, microbatch: int) -> None:
        self._send(g, self.stage - 1, 2 * microbatch + 1)

    def recv_backward(self, shape, dtype, device, microbatch: int) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.stage + 1, 2 * microbatch + 1,
                          f"gradients of micro-batch {microbatch}")

    def finish(self) -> None:
        """Complete every send of the step (bounded, naming the peer that did not take it)."""
        sends, self._sends = self._sends, []
        deadline = time.monotonic() + self.timeout  # for all of them
        for work, _, dst, tag in sends:
            try:
                if work.wait(datetime.timedelta(seconds=time_left(deadline))) is False:
                    raise RuntimeError("the wait timed out")
            except RuntimeError as e:
                raise PipelineError(f"{self.who}: stage {dst} did not take the "
                                    f"{_what(tag)} of micro-batch {tag // 2} within {self.timeout:g} s: {e}") from e


def _what(tag: int) -> str:
    return "activations" if tag % 2 == 0 else "gradients"


def run_schedule(link: StageLink, microbatches: int, *, forward: Callable, loss: Callable, shape: Callable,
                 dtype: torch.dtype, device, extra: int = 0, after_forward: Callable | None = None
                 ) -> list[torch.Tensor]:
    """Run this stage's 1F1B schedule; returns the last stage's per-micro-batch losses (detached).

    forward(m, x, carried) -> (out, carried_out): this stage's layers on micro-batch m; x is None on
      the first stage (it embeds); ``carried`` are the ``extra`` columns received with x (relay);
      carried_out the columns to send on with out (detached: no gradient flows back through them).
    loss(m, out, carried) -> 0-dim loss of micro-batch m (last stage only); backward runs from it.
    shape(m) -> the (…, H) shape of micro-batch m's activations; ``extra`` columns are appended.
    after_forward(m): runs once micro-batch m's activations are sent (e.g. its taps go out then).
    """
    s, last = link.stage, link.stage == link.stages - 1
    saved, losses = {}, []
    for op, m in one_f_one_b(s, link.stages, microbatches):
        if op == "F":
            x = carried = None
            if s > 0:
                *lead, h = shape(m)
                recv = link.recv_forward((*lead, h + extra), dtype, device, m)
                x, carried = recv[..., :h].requires_grad_(), recv[..., h:]
            out, carried_out = forward(m, x, carried)
            if last:
                saved[m] = (x, loss(m, out, carried_out))
            else:
                link.send_forward(out.detach() if carried_out is None else
                                  torch.cat([out.detach(), carried_out], -1), m)
                saved[m] = (x, out)
            if after_forward is not None:
                after_forward(m)
        else:
            x, out = saved.pop(m)
            if last:
                out.backward()
                losses.append(out.detach())
            else:
                out.backward(link.recv_backward(out.shape, out.dtype, device, m))
            if s > 0:
                link.send_backward(x.grad, m)
    link.finish()
    return losses
