"""TapChannel on real gloo groups, both transports (shared memory, point-to-point).

Oracles: the consumer receives bitwise what each producer put, detached, whatever the order of
gets within the in-flight window and across steps (slots wrap around); every fault fails loudly
and in bounded time with a message naming who and what: a stale or reordered stamp, a producer
that never puts (stage, micro-batch, tap), a tensor bigger than its slot (both sizes), a consumer
that never frees a slot (the producer waits, bounded, and nothing is overwritten).
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from codraft.parallel.tapchannel import (
    TapSizeError,
    TapSpec,
    TapStaleError,
    TapTimeout,
    open_tap_channel,
)

TRANSPORTS = ("shm", "p2p")
H, T = 8, 16  # hidden size, max tokens per micro-batch


def _features(step, mb, tap, ntok=None):
    """Deterministic, distinct per (step, micro-batch, tap); token count varies too."""
    g = torch.Generator().manual_seed(step * 10007 + mb * 101 + tap)
    n = ntok if ntok is not None else 1 + (step * 7 + mb * 3 + tap) % T
    return torch.randn(n, H, generator=g)


def _roundtrip(rank, world, transport):
    # stages 0, 1 produce taps (1, 2) and (5,); stage 2 consumes and owns tap 7 itself
    spec = TapSpec(max_tokens=T, hidden=H, taps=((1, 2), (5,), (7,)), in_flight=2, timeout=20.0)
    ch = open_tap_channel(spec, transport)
    steps = 3  # 4 micro-batches through 2 slots, 3 steps: slots wrap around within and across steps
    if rank == 2:  # shm: the consumer unlinked the segment once every stage had mapped it
        assert not os.path.exists(getattr(ch, "path", None) or "/nonexistent")
    with ch:
        for step in range(steps):
            for pair in ((0, 1), (2, 3)):  # two in flight at a time
                if rank < 2:
                    for mb in pair:
                        for tap in spec.taps[rank]:
                            x = _features(step, mb, tap).requires_grad_(True)
                            ch.put(step, mb, tap, x * 1)  # requires grad: put must detach
                else:
                    for mb in pair:
                        ch.put(step, mb, 7, _features(step, mb, 7))
                    for mb in reversed(pair):  # out of order: micro-batch 1 before 0
                        for tap in (5, 7, 2, 1):
                            if tap == 2 and mb == pair[0]:  # a view, released after use
                                y = ch.get(step, mb, tap, view=True)
                                assert torch.equal(y, _features(step, mb, tap))
                                ch.release(step, mb, tap)
                                continue
                            y = ch.get(step, mb, tap)
                            want = _features(step, mb, tap)
                            assert y.shape == want.shape and not y.requires_grad, (step, mb, tap)
                            assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (step, mb, tap)
    return rank


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_roundtrip_out_of_order_and_wraparound(transport):
    assert run_ranks(_roundtrip, 3, transport, timeout=90) == [0, 1, 2]


def _expect(exc_type, fn, *patterns):
    with pytest.raises(exc_type) as e:
        fn()
    msg = str(e.value)
    for p in patterns:
        assert re.search(p, msg), (p, msg)
    return msg


def _faults(rank, world, transport):
    """Producer rank 0 owns tap 5, consumer rank 1 owns nothing; a fresh channel per case."""
    spec = TapSpec(max_tokens=512, hidden=576, taps=((5,), ()), in_flight=2, timeout=20.0)
    x = lambda n=4: torch.ones(n, 576)
    world_barrier = dist.barrier  # the default group: never the channel's own

    # a tensor bigger than its slot: both sizes in the error
    ch = open_tap_channel(spec, transport)
    if rank == 0:
        _expect(TapSizeError, lambda: ch.put(0, 3, 5, x(700)), r"tap 5 of micro-batch 3", r"700 × 576",
                r"512 × 576")
    world_barrier()

    # a missing producer: the consumer times out naming stage, micro-batch and tap
    ch = open_tap_channel(spec, transport)
    if rank == 1:
        t0 = time.monotonic()
        _expect(TapTimeout, lambda: ch.get(0, 1, 5, timeout=0.3), r"no tap 5 of micro-batch 1 \(step 0\)",
                r"from stage 0 \(rank 0")
        assert time.monotonic() - t0 < 10
    world_barrier()

    # a stale stamp: micro-batch 1 of step 3 was never consumed, step 4 asks for it
    ch = open_tap_channel(spec, transport)
    if rank == 0:
        ch.put(3, 1, 5, x())
    world_barrier()
    if rank == 1:
        _expect(TapStaleError, lambda: ch.get(4, 1, 5, timeout=5),
                re.escape("slot 1 of tap 5 holds (step 3, micro-batch 1, tap 5), "
                          "expected (step 4, micro-batch 1, tap 5)"))
    world_barrier()

    # a reordered write: micro-batch 2 put into slot 0 while the consumer expects micro-batch 0
    ch = open_tap_channel(spec, transport)
    if rank == 0:
        ch.put(0, 2, 5, x())
    world_barrier()
    if rank == 1:
        _expect(TapStaleError, lambda: ch.get(0, 0, 5, timeout=5), re.escape("(step 0, micro-batch 2, tap 5)"),
                re.escape("expected (step 0, micro-batch 0, tap 5)"))
    world_barrier()

    # back-pressure: a third micro-batch waits for slot 0 until the consumer frees it, then goes in
    ch = open_tap_channel(spec, transport)
    delay = 0.4
    if rank == 0:
        ch.put(0, 0, 5, x() * 0)
        ch.put(0, 1, 5, x() * 1)
        world_barrier()
        t0 = time.monotonic()
        ch.put(0, 2, 5, x() * 2, timeout=10)
        waited = time.monotonic() - t0
        assert waited >= delay * 0.5, waited
    else:
        world_barrier()
        time.sleep(delay)
        for mb in (0, 1, 2):  # nothing was overwritten: each micro-batch holds its own values
            assert torch.equal(ch.get(0, mb, 5, timeout=10), x() * mb)
    world_barrier()

    # ... and times out, naming the slot's holder, when the consumer never frees it
    ch = open_tap_channel(spec, transport)
    if rank == 0:
        ch.put(0, 0, 5, x() * 0)
        ch.put(0, 1, 5, x() * 1)
        _expect(TapTimeout, lambda: ch.put(0, 2, 5, x() * 2, timeout=0.3),
                r"cannot put tap 5 of micro-batch 2 \(step 0\)",
                re.escape("slot 0 still holds (step 0, micro-batch 0, tap 5)"), r"not freed by the consumer")
    world_barrier()
    if rank == 1 and transport == "shm":  # the slot still holds micro-batch 0: nothing overwritten
        assert torch.equal(ch.get(0, 0, 5, timeout=1), x() * 0)
    world_barrier()
    return rank


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_faults(transport):
    assert run_ranks(_faults, 2, transport, timeout=90) == [0, 1]


def test_spec_rejects_duplicate_taps():
    with pytest.raises(ValueError, match="unique"):
        TapSpec(max_tokens=4, hidden=2, taps=((1, 2), (2,)))
