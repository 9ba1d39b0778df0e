"""The signal and full-disk plumbing of `codraft train` (``codraft.rl.interrupt``, ``codraft.train.disk_full``);
the runs that use them are in tests/integration/test_stops.py and tests/distributed/test_dp_signals.py."""
from __future__ import annotations

import errno
import os
import signal

import pytest
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from codraft.rl.interrupt import Interrupted, Signals, exit_code, hold_signals
from codraft.train.disk_full import is_disk_full


@pytest.fixture(autouse=True)
def sigterm_restored():
    old = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, old)


def test_one_process_stops_at_once_but_not_inside_a_held_block():
    done, before = [], signal.getsignal(signal.SIGTERM)
    with Signals(immediate=True) as signals:
        with pytest.raises(Interrupted) as stop:
            with hold_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("the block ran to its end")
        assert done and stop.value.exit_code == 143 and exit_code(stop.value) == 143
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal, while the save is on its way: only recorded
        assert signals.got == signal.SIGTERM and signals.agreed(None, 1) == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # restored
    assert exit_code(KeyboardInterrupt()) == 130


class _World:
    """Stands for the ranks' group: every rank's flag, as all_gather_object returns them."""

    def __init__(self, flags):
        self.flags, self.asked = flags, []

    def all_gather_object(self, obj, what):
        self.asked.append(what)
        return self.flags


def test_several_ranks_only_flag_a_signal_and_stop_on_the_lowest_rank_s():
    with Signals(immediate=False) as signals:
        os.kill(os.getpid(), signal.SIGTERM)  # no exception: the step goes on to its boundary
        assert signals.got == signal.SIGTERM
    world = _World([0, signal.SIGTERM, signal.SIGINT])
    assert Signals(immediate=False).agreed(world, 3) == signal.SIGTERM  # this rank got none, rank 1 did
    assert world.asked == ["the ranks' stop flags after step 3"]
    assert Signals(immediate=False).agreed(_World([0, 0]), 3) == 0


def test_a_full_disk_is_recognised_in_every_shape_the_writers_give_it():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(full) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert is_disk_full(CheckpointException("write", {1: (full, None)}))  # one rank's, in DCP's exception
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("writing failed") from e
    except RuntimeError as e:
        assert is_disk_full(e)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(ValueError("x"))
    assert not is_disk_full(CheckpointException("write", {0: (ValueError("x"), None)}))
