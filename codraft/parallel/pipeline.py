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
naming this stage, the peer stage, the micro-batch and the direction. A send to the stage that the
next receive comes from goes in one batch with it (``StageLink``); other sends are completed at the
end of the schedule (one outstanding send per direction and micro-batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from codraft.errors import CodraftError
from codraft.parallel.comm import wait_all


class PipelineError(CodraftError, RuntimeError):
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


def stage_parameters(policy, stage: int, stages: int, *, tied_once: bool = False) -> list[torch.nn.Parameter]:
    """The policy parameters stage ``stage`` trains: its layers, the embedding on the first, the final
    norm and the head on the last (a tied head is the embedding: on both, or ``tied_once`` only on the first)."""
    out = [policy.embed_tokens.weight] if stage == 0 else []
    for i in stage_layers(policy.config.num_hidden_layers, stages)[stage]:
        out += list(policy.layers[i].parameters())
    if stage == stages - 1:
        out += list(policy.norm.parameters())
        if policy.lm_head is not None or not tied_once:
            out.append(policy.head_weight)
    return list({id(p): p for p in out}.values())


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
class Incoming:
    """A posted receive (with the send posted in its batch, if any): ``wait`` returns the buffer."""
    link: "StageLink"
    buf: torch.Tensor
    works: list
    src: int
    what: str
    sent: torch.Tensor | None = None  # kept alive until the batch completes

    def wait(self) -> torch.Tensor:
        link = self.link
        try:
            wait_all(self.works, time.monotonic() + link.timeout)
        except RuntimeError as e:
            raise PipelineError(f"{link.who}: no {self.what} from stage {self.src} within {link.timeout:g} s "
                                f"(stage {self.src} died or hangs): {e}") from e
        return self.buf


@dataclass
class StageLink:
    """Point-to-point sends between adjacent stages, on the pipeline's own process group
    (``group``: the ranks of stage 0..P−1 in order; None = the world, rank = stage).

    A send to the stage the next receive comes from is posted in one batch with that receive
    (``batch_isend_irecv``): in 1F1B's steady state stage s sends activations to s + 1 while s + 1
    sends it gradients, and on NCCL, which runs a pair's sends and receives on one stream, two lone
    sends can each wait for a receive queued behind the other (Megatron pairs them the same way).
    Other sends are posted alone and completed by ``finish``."""
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

    def _post(self, send: tuple | None, recv: tuple | None) -> Incoming | None:
        """Post ``send`` = (tensor, dst stage, tag) and ``recv`` = (shape, dtype, device, src stage, tag) in
        one batch; the receive's ``Incoming``, or None (a lone send, completed by ``finish``)."""
        ops, x, buf = [], None, None
        if send is not None:
            x, dst, tag = send
            x = x.contiguous()
            ops.append(dist.P2POp(dist.isend, x, self._rank(dst), self.group, tag))
        if recv is not None:
            shape, dtype, device, src, rtag = recv
            buf = torch.empty(shape, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, self._rank(src), self.group, rtag))
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            what = f"cannot send the {_what(tag)} of micro-batch {tag // 2} to stage {dst} (stage {dst} died?)" \
                if send is not None else f"no {_what(rtag)} of micro-batch {rtag // 2} from stage {src}"
            raise PipelineError(f"{self.who}: {what}: {e}") from e
        if recv is None:
            self._sends.append((works, x, dst, tag))
            return None
        return Incoming(self, buf, works, src, f"{_what(rtag)} of micro-batch {rtag // 2}", x)

    def send_forward(self, x: torch.Tensor, microbatch: int, then: tuple | None = None) -> Incoming | None:
        """Activations of ``microbatch`` to the next stage; ``then`` = (shape, dtype, device, micro-batch b):
        post the receive of b's gradients from that stage with it."""
        recv = None if then is None else (*then[:3], self.stage + 1, 2 * then[3] + 1)
        return self._post((x, self.stage + 1, 2 * microbatch), recv)

    def recv_forward(self, shape, dtype, device, microbatch: int) -> torch.Tensor:
        return self._post(None, (shape, dtype, device, self.stage - 1, 2 * microbatch)).wait()

    def send_backward(self, g: torch.Tensor, microbatch: int, then: tuple | None = None) -> Incoming | None:
        """Gradients of ``microbatch`` to the previous stage; ``then`` = (shape, dtype, device, micro-batch f):
        post the receive of f's activations from that stage with it."""
        recv = None if then is None else (*then[:3], self.stage - 1, 2 * then[3])
        return self._post((g, self.stage - 1, 2 * microbatch + 1), recv)

    def recv_backward(self, shape, dtype, device, microbatch: int) -> torch.Tensor:
        return self._post(None, (shape, dtype, device, self.stage + 1, 2 * microbatch + 1)).wait()

    def finish(self) -> None:
        """Complete every lone send of the step (bounded, naming the peer that did not take it)."""
        sends, self._sends = self._sends, []
        deadline = time.monotonic() + self.timeout  # for all of them
        for works, _, dst, tag in sends:
            try:
                wait_all(works, deadline)
            except RuntimeError as e:
                raise PipelineError(f"{self.who}: stage {dst} did not take the "
                                    f"{_what(tag)} of micro-batch {tag // 2} within {self.timeout:g} s: {e}") from e


def _what(tag: int) -> str:
    return "activations" if tag % 2 == 0 else "gradients"


def run_schedule(link: StageLink, microbatches: int, *, forward: Callable, loss: Callable, shape: Callable,
                 dtype: torch.dtype, device, extra: int = 0, after_forward: Callable | None = None,
                 before_backward: Callable | None = None) -> list[torch.Tensor]:
    """Run this stage's 1F1B schedule; returns the last stage's per-micro-batch losses (detached).

    forward(m, x, carried) -> (out, carried_out): this stage's layers on micro-batch m; x is None on
      the first stage (it embeds); ``carried`` are the ``extra`` columns received with x (relay);
      carried_out the columns to send on with out (detached: no gradient flows back through them).
    loss(m, out, carried) -> 0-dim loss of micro-batch m (last stage only); backward runs from it.
    shape(m) -> the (…, H) shape of micro-batch m's activations; ``extra`` columns are appended.
    after_forward(m): runs once micro-batch m's activations are sent (e.g. its taps go out then).
    before_backward(final): runs before each backward; ``final``: it is this stage's last of the step.
    """
    s, last = link.stage, link.stage == link.stages - 1
    ops = one_f_one_b(s, link.stages, microbatches)

    def received(m):  # what micro-batch m's activations arrive as: its shape plus the carried columns
        *lead, h = shape(m)
        return (*lead, h + extra)
    saved, losses, incoming = {}, [], {}  # incoming: ("F" | "B", m) -> a receive posted with the last send
    for i, (op, m) in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if op == "F":
            x = carried = None
            if s > 0:
                h = shape(m)[-1]
                recv = incoming.pop(("F", m)).wait() if ("F", m) in incoming else \
                    link.recv_forward(received(m), dtype, device, m)
                x, carried = recv[..., :h].requires_grad_(), recv[..., h:]
            out, carried_out = forward(m, x, carried)
            if last:
                saved[m] = (x, loss(m, out, carried_out))
            else:
                saved[m] = (x, out)
                # the next backward receives from the stage this sends to: one batch (StageLink)
                b = nxt[1] if nxt is not None and nxt[0] == "B" else None
                then = None if b is None else (saved[b][1].shape, saved[b][1].dtype, device, b)
                posted = link.send_forward(out.detach() if carried_out is None else
                                           torch.cat([out.detach(), carried_out], -1), m, then)
                if posted is not None:
                    incoming[("B", b)] = posted
            if after_forward is not None:
                after_forward(m)
        else:
            x, out = saved.pop(m)
            if before_backward is not None:
                before_backward(nxt is None)
            if last:
                out.backward()
                losses.append(out.detach())
            else:
                grad = incoming.pop(("B", m)).wait() if ("B", m) in incoming else \
                    link.recv_backward(out.shape, out.dtype, device, m)
                out.backward(grad)
            if s > 0:
                f = nxt[1] if nxt is not None and nxt[0] == "F" else None  # its activations come from there
                then = None if f is None else (received(f), dtype, device, f)
                posted = link.send_backward(x.grad, m, then)
                if posted is not None:
                    incoming[("F", f)] = posted
    link.finish()
    return losses
