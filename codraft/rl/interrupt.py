"""Ctrl-C (SIGINT) and SIGTERM during ``Trainer.fit``: stop after a completed step, save it, exit 128 + the signal.

One process: the signal raises ``Interrupted`` (a ``KeyboardInterrupt``) wherever the run is, so the step in
flight is dropped; ``hold_signals`` holds it back over the commit point and checkpoint writes, which are
all-or-nothing.

Several ranks (torchrun): a rank that stopped mid-step would leave the others waiting in a collective, and
the signal reaches the ranks at different moments or only some of them (torchrun forwards it to each
worker; ``kill`` may reach one). So a signal only sets a flag (``Signals``); at every step boundary the ranks
all-gather their flags (``Signals.agreed``, within ``parallel.timeout``), and when any rank got one, every
rank stops after that same completed step and they save it together.

torchrun (torch 2.13, ``torch.distributed.elastic``) itself handles SIGINT, SIGTERM, SIGHUP and SIGQUIT
(``--signals-to-handle``): it sends the signal on to every worker's process group (each worker leads a
process group of its own (setsid), so a terminal's Ctrl-C reaches the launcher alone), waits ``--shutdown-timeout``
seconds (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30) for them to exit, SIGKILLs those still alive,
then exits with its own ``SignalException`` traceback. The step in flight and the save must fit in that
grace period: raise ``--shutdown-timeout`` for runs whose steps are long.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run stops on ``signum``: its last completed step is (being) saved; the command exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # 130 for SIGINT, 143 for SIGTERM: what a shell reports for them


def exit_code(e: KeyboardInterrupt) -> int:
    return e.exit_code if isinstance(e, Interrupted) else 128 + signal.SIGINT


def ignore_signals() -> None:
    """SIGINT and SIGTERM ignored from here on: for a process that is exiting after a stop, so that the
    SIGTERM torchrun sends to every worker once one has exited cannot turn its exit status into -15."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _handled(signum: int) -> bool:
    """May this process replace ``signum``'s handler? Only the main thread receives signals; an ignored one
    (a background job, a pytest-xdist worker) stays ignored, and None is a handler set outside Python."""
    old = signal.getsignal(signum)
    return threading.current_thread() is threading.main_thread() and old is not None and old != signal.SIG_IGN


@contextlib.contextmanager
def hold_signals():
    """Defer SIGINT and SIGTERM to the end of the block, so the block (the optimiser updates, a checkpoint
    write) is all-or-nothing; the first one held is then delivered as it would have been."""
    got, old = [], {}
    for s in SIGNALS:
        if _handled(s):
            old[s] = signal.signal(s, lambda *a: got.append(a))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            s, frame = got[0]
            if callable(old[s]):
                old[s](s, frame)  # raises Interrupted or KeyboardInterrupt here, or sets Signals' flag
            elif old[s] == signal.SIG_DFL:
                signal.raise_signal(s)


class Signals:
    """SIGINT and SIGTERM while the block runs: ``immediate`` (one process) raises ``Interrupted`` at once,
    otherwise (several ranks) only ``got`` is set, for ``agreed`` at the next step boundary. ``stopping``:
    from then on signals are only recorded, so a second Ctrl-C lets the save finish."""

    def __init__(self, immediate: bool):
        self.immediate, self.got, self._old = immediate, 0, {}

    def __enter__(self) -> "Signals":
        for s in SIGNALS:
            if _handled(s):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        self.got = self.got or signum
        if self.immediate:
            self.immediate = False  # a second signal, before the save has begun, must not abandon it
            raise Interrupted(signum)

    def stopping(self) -> None:
        self.immediate = False

    def agreed(self, world, step: int) -> int:
        """The signal every rank stops on after step ``step`` (the lowest rank's that got one), or 0 to go
        on: collective where ``world`` is a process group (a peer that hangs fails it within its timeout)."""
        if world is None:
            return self.got
        flags = world.all_gather_object(self.got, f"the ranks' stop flags after step {step}")
        return next((f for f in flags if f), 0)
