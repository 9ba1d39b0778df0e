"""A process group whose collectives and ring exchange time out with errors that name who hangs.

``Group`` wraps a torch.distributed group (the world, or one of the mesh's: gloo on CPU, NCCL on GPU,
the backend chosen from the device when the world is joined, see ``join_world``). Its collectives
fail with ``PeerError`` naming this rank's place in the mesh and what was exchanged. A ring step sends the tensor it
holds to the next rank and receives the previous rank's: ``exchange`` posts both at once and
returns a handle; ``wait`` blocks at most ``timeout`` seconds and then raises ``PeerError`` naming
this rank, the ring step, what it was waiting for and from which rank. A dead peer (closed
connection) is reported the same way. One send and one receive per purpose (K/V, dK/dV) are in
flight at a time, each purpose with its own tag: gloo may hang with several outstanding
messages to one peer, and NCCL ignores tags, so the order of posting is the same on every rank.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from codraft.errors import CodraftError


class PeerError(CodraftError, RuntimeError):
    """A peer rank (of any parallel dimension) did not deliver in time, or died."""


@dataclass
class Group:
    group: dist.ProcessGroup | None  # None: the default (world) group
    rank: int
    size: int
    timeout: float = 300.0  # seconds a ring step waits for its peer
    sent_bytes: int = 0     # bytes this rank has sent point-to-point (benchmarks read and reset it)
    where: str = ""         # this rank in a PP × CP mesh (``Mesh.where``), for the errors; else its CP rank

    @property
    def who(self) -> str:
        return self.where or f"CP rank {self.rank}/{self.size}"

    @classmethod
    def world(cls, timeout: float = 300.0) -> "Group":
        return cls(None, dist.get_rank(), dist.get_world_size(), timeout)

    def global_rank(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, what: str, step: int, tag: int) -> "Pending":
        """Post send → next rank and recv ← previous rank; ``Pending.wait`` completes both."""
        self.sent_bytes += send.numel() * send.element_size()
        pending = Pending(self, [], what, step)
        # one batch: with 2 ranks next = prev, and NCCL runs a pair's sends and receives on one stream, where
        # a send posted alone can wait for a receive the peer queued behind its own send (gloo matches either way)
        ops = [dist.P2POp(dist.isend, send.contiguous(), self.global_rank(self.next), self.group, tag),
               dist.P2POp(dist.irecv, recv, self.global_rank(self.prev), self.group, tag)]
        with pending.naming():  # posting can fail too: a peer that died closed the connection
            pending.works = dist.batch_isend_irecv(ops)
        return pending

    def all_reduce(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Sum over the group, in place; a hang surfaces as the group's timeout, named here."""
        if self.size == 1:
            return x
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:
            raise PeerError(f"{self.who}: all-reduce of {what} failed: {e}") from e
        return x

    def all_gather(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on every rank), in rank order."""
        if self.size == 1:
            return [x]
        out = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(out, x, group=self.group)
        except RuntimeError as e:
            raise PeerError(f"{self.who}: all-gather of {what} failed: {e}") from e
        return out

    def all_gather_object(self, obj, what: str) -> list:
        """Every rank's ``obj``, tensors in it moved to the host first: a pickled CUDA tensor comes back on
        the sender's GPU index, which another rank may not have."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        try:
            dist.all_gather_object(out, on_host(obj), group=self.group)
        except RuntimeError as e:
            raise PeerError(f"{self.who}: all-gather of {what} failed: {e}") from e
        return out


@dataclass
class Pending:
    comm: Group
    works: list
    what: str
    step: int

    def wait(self) -> None:
        with self.naming():
            wait_all(self.works, time.monotonic() + self.comm.timeout)  # the send and the receive together

    @contextlib.contextmanager
    def naming(self):
        c = self.comm
        try:
            yield
        except RuntimeError as e:
            raise PeerError(f"{c.who}: ring step {self.step + 1} of {c.size} got no {self.what} from CP rank {c.prev} "
                            f"(or could not send to CP rank {c.next}) within {c.timeout:g} s: {e}") from e


def on_host(obj):
    """``obj`` with every tensor in its dicts, lists and tuples detached and on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_host(v) for v in obj)
    return obj


def time_left(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``), for the next of several waits that share one
    timeout; never 0, which some backends read as no limit."""
    return max(deadline - time.monotonic(), 1e-3)


def wait_all(works, deadline: float) -> None:
    """Complete every work by ``deadline``, or raise ``RuntimeError`` (the caller says what was awaited)."""
    for w in works:
        if w.wait(datetime.timedelta(seconds=time_left(deadline))) is False:
            raise RuntimeError("the wait timed out")


def backend_for(device: torch.device | str) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def leave_process_group() -> None:
    """Destroy the default process group and every group made from it, while the interpreter is whole. Left
    to the interpreter's exit, gloo's worker threads may still hold tensors whose release needs the GIL, and
    a rank that completed its run aborts (SIGABRT, "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()


def join_world(device: torch.device | str = "cpu", timeout: float = 300.0, needs: str = "parallel.cp=C",
               nproc: int | str = "C") -> Group:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT) once and return the
    world (every layout's mesh is built on it: ``codraft.parallel.mesh``). Without torchrun: a PeerError
    saying how to launch ``nproc`` processes for the keys ``needs`` (as the user wrote them)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise PeerError(f"{needs} needs torchrun, one process per rank: torchrun --standalone --nproc-per-node "
                            f"{nproc} -m codraft train [...] {needs}")
        d, bound = torch.device(device), {}
        if d.type == "cuda":  # one GPU per rank: "cuda" means this rank's (LOCAL_RANK)
            if d.index is not None and int(os.environ.get("WORLD_SIZE", 1)) > 1:
                raise PeerError(f"device={device} would put every rank on GPU {d.index}: give device=cuda, and each "
                                "rank takes the GPU of its LOCAL_RANK")
            gpu = d.index if d.index is not None else int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(gpu)
            # bound to this rank's GPU, NCCL sets up each group's communicator when the group is made: a batched
            # send to a subset of a group (a pipeline stage's) as its first call is otherwise undefined
            bound = {"device_id": torch.device("cuda", gpu)}
        dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout), **bound)
    return Group.world(timeout)
