"""The errors codraft raises on purpose: the message says what is wrong and what to do instead.

``codraft.cli.main`` prints any ``CodraftError`` as one line and exits non-zero; anything else (a bug)
keeps its traceback. Each module's own error class derives from ``CodraftError`` and keeps its older
base (``ValueError``, ``RuntimeError``, ...), so callers that catch those still do.
"""
from __future__ import annotations


class CodraftError(Exception):
    """A deliberate, user-facing error."""


class NonFiniteError(CodraftError, RuntimeError):
    """``grpo.max_nonfinite_steps`` updates in a row had a NaN/inf loss or gradient norm: the run stops."""


class MissingPackageError(CodraftError, ModuleNotFoundError):
    """An optional package a command needs is not installed (the message says how to install it)."""
