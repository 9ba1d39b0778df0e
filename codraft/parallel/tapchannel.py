"""TapChannel: the one-way fan-in of tapped hidden states from pipeline stages to the last stage.

Why it exists. Under pipeline parallelism (PP = P) the draft lives on the last stage, but the
layers whose hidden states it reads (the taps, e.g. EAGLE-3's low/mid/high layers) live on earlier
stages. The pipeline's own activation sends only go to the *next* stage, so each producer stage
pushes its taps straight to the consumer over this side channel. The features are sg(H): no
gradient ever flows back, so the channel is one-directional and ``put`` detaches.

Why slots, stamps and credits. Micro-batches of a 1F1B schedule are in flight at once and the
consumer may ask for them in another order than they were produced. Every (tap, micro-batch m)
goes to slot ``m mod in_flight`` of that tap; all buffers are allocated once, from the configured
maximum micro-batch tokens × hidden × taps × in-flight micro-batches, so the training step never
allocates or re-registers memory. Each slot carries a header, the sequence stamp (step,
micro-batch, tap) plus the valid token count and a full/empty state: a stale write (left over
from an earlier step) or a reordered one (micro-batch m + in_flight written before m was
consumed) shows up as a stamp that differs from the one the consumer asks for, and raises, instead
of silently training the draft on another micro-batch's features. A producer never overwrites a
full slot: it waits (bounded) until the consumer frees it (back-pressure). Every wait is bounded
and its error names the stage/rank, step, micro-batch and tap, so a hung pipeline says who hangs.

Two transports behind one interface (``open_tap_channel``):

* ``"shm"``: stages on one host. One shared-memory segment (a file in /dev/shm, mapped with
  ``torch.from_file``) created by the consumer, attached by the producers by name, and unlinked
  as soon as all have mapped it (so a crashed stage cannot leak it). CPU only;
  its GPU analogue (CUDA IPC handles of a pre-allocated device buffer) is not implemented.
* ``"p2p"``: stages on different hosts. Point-to-point ``isend``/``irecv`` on a process group of
  its own (so its messages never interleave with the pipeline's sends), gloo on CPU, NCCL for CUDA
  tensors. Credits returned by the consumer give the back-pressure.

Every process of the default group calls ``open_tap_channel`` (``dist.new_group`` is collective
over the world); processes outside ``ranks`` get ``None``.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist

from codraft.errors import CodraftError
from codraft.parallel.comm import time_left


class TapChannelError(CodraftError, RuntimeError):
    """The tap channel was misused or a peer misbehaved."""


class TapTimeout(TapChannelError, TimeoutError):
    """A bounded wait ran out: the peer named in the message did not deliver (or free) in time."""


class TapStaleError(TapChannelError):
    """A slot holds a stamp other than the one asked for: a stale or reordered write."""


class TapSizeError(TapChannelError, ValueError):
    """A tensor does not fit its slot (or has the wrong hidden size / dtype)."""


EMPTY, FULL = 0, 1
# shared-memory header of one slot: step, micro-batch, tap, tokens, state (+ padding to 64 bytes)
_STEP, _MB, _TAP, _NTOK, _STATE, _HDR = 0, 1, 2, 3, 4, 8


@dataclass(frozen=True)
class TapSpec:
    """What both sides agree on before the first step (identical on every rank).

    ``taps[i]``: the layer ids stage i produces (stage i is ``ranks[i]``); the last stage is the
    consumer and may own taps itself (its puts stay local). Tap ids are unique over stages.
    """
    max_tokens: int
    hidden: int
    taps: tuple[tuple[int, ...], ...]
    in_flight: int = 2
    dtype: torch.dtype = torch.float32
    timeout: float = 300.0  # seconds any single wait may take
    device: str = "cpu"     # where the p2p buffers live ("cuda" → NCCL); shm is CPU only

    def __post_init__(self):
        object.__setattr__(self, "taps", tuple(tuple(int(t) for t in ts) for ts in self.taps))
        flat = [t for ts in self.taps for t in ts]
        if len(set(flat)) != len(flat):
            raise ValueError(f"tap ids must be unique across stages, got {self.taps}")
        if self.max_tokens < 1 or self.hidden < 1 or self.in_flight < 1:
            raise ValueError(f"max_tokens, hidden and in_flight must be positive: {self}")

    @property
    def stages(self) -> int:
        return len(self.taps)

    @property
    def all_taps(self) -> list[int]:
        return [t for ts in self.taps for t in ts]

    def slot_bytes(self) -> int:
        return self.max_tokens * self.hidden * torch.empty((), dtype=self.dtype).element_size()


class _Base:
    """Bookkeeping shared by both transports: which stage owns a tap, sizes, error text."""

    transport = "?"

    def __init__(self, spec: TapSpec, ranks: list[int], group):
        self.spec, self.ranks, self.group = spec, list(ranks), group
        self.stage = self.ranks.index(dist.get_rank())
        self.consumer_stage = spec.stages - 1
        self.owner = {t: s for s, ts in enumerate(spec.taps) for t in ts}
        self.tap_index = {t: i for i, t in enumerate(spec.all_taps)}
        self.closed = False

    # -- naming ---------------------------------------------------------------------------------
    def _who(self, stage: int | None = None) -> str:
        s = self.stage if stage is None else stage
        role = "consumer" if s == self.consumer_stage else "producer"
        return f"stage {s} (rank {self.ranks[s]}, {role})"

    @staticmethod
    def _stamp(step, mb, tap) -> str:
        return f"(step {step}, micro-batch {mb}, tap {tap})"

    @property
    def is_consumer(self) -> bool:
        return self.stage == self.consumer_stage

    def slot(self, microbatch: int) -> int:
        return microbatch % self.spec.in_flight

    # -- checks ---------------------------------------------------------------------------------
    def _check_put(self, step, mb, tap, x: torch.Tensor) -> torch.Tensor:
        if self.closed:
            raise TapChannelError(f"TapChannel {self._who()}: put after close")
        if tap not in self.owner:
            raise TapChannelError(f"TapChannel {self._who()}: unknown tap {tap} (taps: {self.spec.taps})")
        if self.owner[tap] != self.stage:
            raise TapChannelError(f"TapChannel {self._who()}: tap {tap} belongs to stage {self.owner[tap]}")
        x = x.detach()  # sg(H): nothing flows back
        sp = self.spec
        if x.dim() != 2 or x.shape[1] != sp.hidden or x.shape[0] > sp.max_tokens:
            shape = " × ".join(str(d) for d in x.shape)
            raise TapSizeError(f"TapChannel {self._who()}: tap {tap} of micro-batch {mb} (step {step}): "
                               f"{shape} does not fit its slot of {sp.max_tokens} × {sp.hidden} "
                               f"(tokens × hidden)")
        if x.dtype != sp.dtype:
            raise TapSizeError(f"TapChannel {self._who()}: tap {tap} of micro-batch {mb} (step {step}) is "
                               f"{x.dtype}, the channel carries {sp.dtype}")
        return x

    def _check_get(self, tap):
        if self.closed:
            raise TapChannelError(f"TapChannel {self._who()}: get after close")
        if not self.is_consumer:
            raise TapChannelError(f"TapChannel {self._who()}: only the last stage gets")
        if tap not in self.owner:
            raise TapChannelError(f"TapChannel {self._who()}: unknown tap {tap} (taps: {self.spec.taps})")

    def _timeout(self, timeout):
        return self.spec.timeout if timeout is None else float(timeout)

    @contextlib.contextmanager
    def _naming(self, what):
        """A transfer or rendezvous that fails inside (gloo's own error: a dead peer, the group's timeout)
        raises ``TapChannelError`` with ``what()``, which names this stage and what it waited for."""
        try:
            yield
        except TapChannelError:
            raise
        except RuntimeError as e:
            raise TapChannelError(f"{what()}: {e}") from e

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _wait_until(cond, timeout: float) -> bool:
    """Poll ``cond`` until true or ``timeout`` s passed. Spins briefly (yielding the core), then
    backs off to sleeps of at most 0.5 ms: shared memory has no wake-up, and a hot spin would
    steal the core a producer stage needs."""
    if cond():
        return True
    deadline = time.monotonic() + timeout
    delay = 0.0
    while True:
        time.sleep(delay)
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        delay = min(5e-4, delay * 2 + 1e-5)


class ShmTapChannel(_Base):
    """Stages on one host: one shared segment, headers then slot data, polled.

    Layout: int64 headers [taps, in_flight, 8] (padded to 64 bytes each), then data
    [taps, in_flight, max_tokens, hidden]. State transitions are single-writer per slot: only the
    tap's producer sets EMPTY → FULL, only the consumer sets FULL → EMPTY. The writer stores the
    data (and stamp) first and the state last; the reader checks the state before reading. Python
    issues these as separate stores in program order, and x86 (TSO) keeps store→store and
    load→load order, which is all this needs; a weakly ordered CPU (ARM) would need a fence
    between the data and the state store, which Python cannot express: not supported there.
    """

    transport = "shm"

    def __init__(self, spec: TapSpec, ranks: list[int], group):
        super().__init__(spec, ranks, group)
        if torch.device(spec.device).type != "cpu":
            raise TapChannelError("the shm transport is CPU only (CUDA IPC, its GPU analogue, is not implemented)")
        n, k = len(spec.all_taps), spec.in_flight
        self._hdr_bytes = n * k * _HDR * 8
        size = self._hdr_bytes + n * k * spec.slot_bytes()
        self.path, self.creator = None, False
        err = None
        if self.is_consumer:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.path = os.path.join(base or tempfile.gettempdir(), f"codraft-tap-{uuid.uuid4().hex}")
            try:
                with open(self.path, "wb") as f:  # zero-filled: every state EMPTY
                    f.truncate(size)
                self.creator = True
            except OSError as e:
                err = f"{self._who()} could not create {self.path}: {e}"
        names = [None] * len(ranks)
        with self._naming(lambda: f"TapChannel {self._who()}: opening: the segment's name from every stage"):
            dist.all_gather_object(names, (self.path, err), group=group)
        path, err = names[self.consumer_stage]
        if err:
            raise TapChannelError(f"TapChannel: {err}")
        self.path = path
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._raw = raw
        self.hdr = raw[:self._hdr_bytes].view(torch.int64).view(n, k, _HDR)
        self.data = raw[self._hdr_bytes:].view(spec.dtype).view(n, k, spec.max_tokens, spec.hidden)
        with self._naming(lambda: f"TapChannel {self._who()}: opening: every stage mapping the segment"):
            dist.barrier(group=group)  # everyone has mapped it: the name is no longer needed
        if self.creator:  # unlink now: the mappings live on, and a crash cannot leak the segment
            os.unlink(path)
            self.creator = False

    def put(self, step: int, microbatch: int, tap: int, tensor: torch.Tensor, timeout: float | None = None):
        x = self._check_put(step, microbatch, tap, tensor)
        ti, s = self.tap_index[tap], self.slot(microbatch)
        h = self.hdr[ti, s]
        t = self._timeout(timeout)
        if not _wait_until(lambda: int(h[_STATE]) == EMPTY, t):
            held = self._stamp(*h[:3].tolist())
            raise TapTimeout(f"TapChannel {self._who()}: cannot put tap {tap} of micro-batch {microbatch} "
                             f"(step {step}): slot {s} still holds {held}, not freed by the consumer "
                             f"{self._who(self.consumer_stage)} within {t:g} s")
        ntok = x.shape[0]
        self.data[ti, s, :ntok].copy_(x)
        h[:4] = torch.tensor([step, microbatch, tap, ntok])
        h[_STATE] = FULL  # last: publishes the data and stamp above

    def get(self, step: int, microbatch: int, tap: int, timeout: float | None = None, *,
            view: bool = False) -> torch.Tensor:
        """The features of (step, micro-batch, tap): a copy (the slot is freed at once), or with
        ``view=True`` a view into the slot, valid until ``release`` (the slot stays taken)."""
        self._check_get(tap)
        ti, s = self.tap_index[tap], self.slot(microbatch)
        h = self.hdr[ti, s]
        t = self._timeout(timeout)
        if not _wait_until(lambda: int(h[_STATE]) == FULL, t):
            src = self.owner[tap]
            raise TapTimeout(f"TapChannel {self._who()}: no tap {tap} of micro-batch {microbatch} (step {step}) "
                             f"from {self._who(src)} within {t:g} s")
        got = tuple(h[:3].tolist())
        if got != (step, microbatch, tap):
            raise TapStaleError(f"TapChannel {self._who()}: slot {s} of tap {tap} holds {self._stamp(*got)}, "
                                f"expected {self._stamp(step, microbatch, tap)}")
        out = self.data[ti, s, :int(h[_NTOK])]
        if view:
            return out
        out = out.clone()
        h[_STATE] = EMPTY
        return out

    def release(self, step: int, microbatch: int, tap: int) -> None:
        """Free the slot a ``get(..., view=True)`` left taken."""
        self._check_get(tap)
        h = self.hdr[self.tap_index[tap], self.slot(microbatch)]
        got = tuple(h[:3].tolist())
        if int(h[_STATE]) != FULL or got != (step, microbatch, tap):
            raise TapStaleError(f"TapChannel {self._who()}: release of {self._stamp(step, microbatch, tap)} but "
                                f"slot {self.slot(microbatch)} holds {self._stamp(*got)} "
                                f"({'full' if int(h[_STATE]) == FULL else 'empty'})")
        h[_STATE] = EMPTY

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hdr = self.data = self._raw = None  # the memory goes with the last mapping


class P2PTapChannel(_Base):
    """Stages on different hosts: isend/irecv on the channel's own process group.

    Per (tap, slot) three tags: a header (step, micro-batch, tap, tokens), the data (only the
    valid tokens, into the consumer's pre-allocated slot), and a credit the consumer sends back
    when it frees the slot. A producer holds one credit per slot at start and spends it on a put;
    the next put to that slot waits (bounded) for the credit to return: the back-pressure, and the
    proof that the consumer has received the previous data, so the producer's send buffer (its own
    pre-allocated copy, so the caller may reuse its tensor at once) can be rewritten.

    The consumer receives on demand in ``get``, header first (so a stale or reordered stamp is
    seen before any data is accepted), then exactly the announced tokens. gloo matches messages by
    tag, so out-of-order gets work. NCCL ignores tags: there every get must come in the order of
    the puts per producer (not tested here: no GPUs).
    """

    transport = "p2p"

    def __init__(self, spec: TapSpec, ranks: list[int], group):
        super().__init__(spec, ranks, group)
        n, k, dev = len(spec.all_taps), spec.in_flight, torch.device(spec.device)
        self.device = dev
        mine = [t for t in spec.taps[self.stage]]
        if self.is_consumer:
            self.data = torch.empty(n, k, spec.max_tokens, spec.hidden, dtype=spec.dtype, device=dev)
            self.state = [[EMPTY] * k for _ in range(n)]
            self.stamps = [[None] * k for _ in range(n)]
            self._credit_sends: list = []
            self._one = torch.ones(1, dtype=torch.int64, device=dev)
        else:
            # the producer's own slot copies and outstanding work per (tap, slot)
            self.send_buf = {t: torch.empty(k, spec.max_tokens, spec.hidden, dtype=spec.dtype, device=dev)
                             for t in mine}
            self.send_hdr = {t: torch.zeros(k, 4, dtype=torch.int64, device=dev) for t in mine}
            self.sends = {(t, s): [] for t in mine for s in range(k)}
            self.credit_recv = {(t, s): None for t in mine for s in range(k)}  # None: credit in hand
            self.credit_buf = {(t, s): torch.zeros(1, dtype=torch.int64, device=dev) for t in mine for s in range(k)}
            self.last_stamp = {(t, s): None for t in mine for s in range(k)}
        self._hdr_in = torch.zeros(4, dtype=torch.int64, device=dev)
        with self._naming(lambda: f"TapChannel {self._who()}: opening: every stage ready"):
            dist.barrier(group=group)

    def _tag(self, tap: int, slot: int, kind: int) -> int:
        return (self.tap_index[tap] * self.spec.in_flight + slot) * 3 + kind

    def _grank(self, stage: int) -> int:
        return self.ranks[stage]

    def _wait(self, work, t: float, what) -> None:
        try:
            ok = work.wait(datetime.timedelta(seconds=t))
        except RuntimeError as e:
            raise TapTimeout(f"{what()} within {t:g} s: {e}") from e
        if ok is False:
            raise TapTimeout(f"{what()} within {t:g} s")

    def put(self, step: int, microbatch: int, tap: int, tensor: torch.Tensor, timeout: float | None = None):
        x = self._check_put(step, microbatch, tap, tensor)
        s, t = self.slot(microbatch), self._timeout(timeout)
        if self.is_consumer:  # a tap of the last stage itself: no message, same slot rules
            ti = self.tap_index[tap]
            if self.state[ti][s] == FULL:  # nobody else can free it: waiting would only time out
                raise TapTimeout(f"TapChannel {self._who()}: cannot put tap {tap} of micro-batch {microbatch} "
                                 f"(step {step}): slot {s} still holds {self._stamp(*self.stamps[ti][s])}, "
                                 f"not freed by this consumer")
            self.data[ti, s, :x.shape[0]].copy_(x)
            self.stamps[ti][s], self.state[ti][s] = (step, microbatch, tap, x.shape[0]), FULL
            return
        key = (tap, s)
        held = self.last_stamp[key]  # what the slot's previous put sent
        if self.credit_recv[key] is not None:
            self._wait(self.credit_recv[key], t, lambda: (
                f"TapChannel {self._who()}: cannot put tap {tap} of micro-batch {microbatch} (step {step}): "
                f"slot {s} still holds {self._stamp(*held)}, not freed by the consumer "
                f"{self._who(self.consumer_stage)}"))
            self.credit_recv[key] = None
        for w in self.sends[key]:  # the consumer has the previous message: these are done (bounded all the same)
            self._wait(w, t, lambda: f"TapChannel {self._who()}: the previous put of slot {s}, {self._stamp(*held)}, "
                                     f"not received by the consumer {self._who(self.consumer_stage)}")
        n = x.shape[0]
        buf, hdr = self.send_buf[tap][s], self.send_hdr[tap][s]
        buf[:n].copy_(x)
        hdr.copy_(torch.tensor([step, microbatch, tap, n]))
        dst = self._grank(self.consumer_stage)
        with self._naming(lambda: f"TapChannel {self._who()}: cannot send tap {tap} of micro-batch {microbatch} "
                                  f"(step {step}) to the consumer {self._who(self.consumer_stage)}"):
            self.sends[key] = [dist.isend(hdr, dst, group=self.group, tag=self._tag(tap, s, 0))]
            if n:
                self.sends[key].append(dist.isend(buf[:n], dst, group=self.group, tag=self._tag(tap, s, 1)))
            self.last_stamp[key] = (step, microbatch, tap)
            self.credit_recv[key] = dist.irecv(self.credit_buf[key], dst, group=self.group,
                                               tag=self._tag(tap, s, 2))

    def get(self, step: int, microbatch: int, tap: int, timeout: float | None = None, *,
            view: bool = False) -> torch.Tensor:
        """As ``ShmTapChannel.get``."""
        self._check_get(tap)
        ti, s, t = self.tap_index[tap], self.slot(microbatch), self._timeout(timeout)
        src = self.owner[tap]
        if self.state[ti][s] == EMPTY:
            if src == self.stage:
                raise TapTimeout(f"TapChannel {self._who()}: no tap {tap} of micro-batch {microbatch} "
                                 f"(step {step}) was put by this stage itself")
            what = lambda: (f"TapChannel {self._who()}: no tap {tap} of micro-batch {microbatch} (step {step}) "
                            f"from {self._who(src)}")
            with self._naming(what):  # (posting a receive fails at once where the peer has died)
                work = dist.irecv(self._hdr_in, self._grank(src), group=self.group, tag=self._tag(tap, s, 0))
            self._wait(work, t, what)
            stamp = tuple(self._hdr_in.tolist())
            self.stamps[ti][s], self.state[ti][s] = stamp, FULL
            if stamp[:3] == (step, microbatch, tap) and stamp[3]:
                with self._naming(what):
                    work = dist.irecv(self.data[ti, s, :stamp[3]], self._grank(src), group=self.group,
                                      tag=self._tag(tap, s, 1))
                self._wait(work, t, what)
        got = self.stamps[ti][s]
        if got[:3] != (step, microbatch, tap):
            # a stale/reordered header: its data stays unreceived, the channel is unusable now
            raise TapStaleError(f"TapChannel {self._who()}: slot {s} of tap {tap} holds {self._stamp(*got[:3])}, "
                                f"expected {self._stamp(step, microbatch, tap)}")
        out = self.data[ti, s, :got[3]]
        if view:
            return out
        out = out.clone()
        self._free(ti, s, tap)
        return out

    def release(self, step: int, microbatch: int, tap: int) -> None:
        self._check_get(tap)
        ti, s = self.tap_index[tap], self.slot(microbatch)
        got = self.stamps[ti][s]
        if self.state[ti][s] != FULL or got[:3] != (step, microbatch, tap):
            raise TapStaleError(f"TapChannel {self._who()}: release of {self._stamp(step, microbatch, tap)} but "
                                f"slot {s} holds {self._stamp(*got[:3]) if got else 'nothing'}")
        self._free(ti, s, tap)

    def _free(self, ti, s, tap):
        self.state[ti][s] = EMPTY
        src = self.owner[tap]
        if src != self.stage:
            self._credit_sends = [w for w in self._credit_sends if not w.is_completed()]
            with self._naming(lambda: f"TapChannel {self._who()}: cannot return the credit of slot {s} of tap {tap} "
                                      f"to {self._who(src)}"):
                self._credit_sends.append(dist.isend(self._one, self._grank(src), group=self.group,
                                                     tag=self._tag(tap, s, 2)))

    def close(self, timeout: float | None = None) -> None:
        """Wait (bounded) until the consumer has received every put and every credit has left:
        gloo sends only complete once the peer receives, and a process that exits first closes
        the connection under them. Credits nobody will spend are abandoned."""
        if self.closed:
            return
        self.closed = True
        t = self._timeout(timeout)
        if self.is_consumer:
            pending = [(w, "a credit to a producer") for w in self._credit_sends]
        else:
            pending = [(w, f"tap {tap} slot {s} ({self._stamp(*self.last_stamp[(tap, s)])})")
                       for (tap, s), ws in self.sends.items() for w in ws]
        deadline = time.monotonic() + t  # for all of them
        for w, what in pending:
            self._wait(w, time_left(deadline), lambda what=what: f"TapChannel {self._who()}: close: {what} not "
                                                                 f"received by its peer")


def open_tap_channel(spec: TapSpec, transport: str = "shm", ranks: list[int] | None = None):
    """Collective over the default group: build the channel's own process group over ``ranks``
    (stage i = ``ranks[i]``, default: the whole world; the last one consumes) and the transport's
    buffers. Returns ``ShmTapChannel`` / ``P2PTapChannel`` on members, ``None`` elsewhere."""
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if len(ranks) != spec.stages:
        raise ValueError(f"{len(ranks)} ranks for {spec.stages} stages of taps {spec.taps}")
    if transport == "shm":
        backend = "gloo"  # the name exchange is CPU objects
    elif transport == "p2p":
        backend = "nccl" if torch.device(spec.device).type == "cuda" else "gloo"
    else:
        raise ValueError(f"unknown TapChannel transport {transport!r} (shm or p2p)")
    group = dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=max(spec.timeout, 60.0)),
                           group_desc=f"taps-{'-'.join(map(str, ranks))}")
    if dist.get_rank() not in ranks:
        return None
    return (ShmTapChannel if transport == "shm" else P2PTapChannel)(spec, ranks, group)
