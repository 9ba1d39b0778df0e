"""Tensor files codraft reads from folders it is given (model, draft and exported folders, run
checkpoints, its cache): a file that is not what it should be is one ``TensorFileError`` naming it.

* ``load_safetensors``: every ``*.safetensors`` read; random bytes or a truncated file are refused
  with the file's path (safetensors' own error names no file).
* ``load_pickle``: ``torch.load(weights_only=True)``, tensors and plain containers only. A pickle
  that names code to call when loaded (a GLOBAL outside torch's allowlist) is refused saying so;
  torch's message about it advises re-running with ``weights_only=False``, the one thing not to do
  with such a file, so only the reason is kept. ``refused`` words that error for other loaders
  (``shard_files``: the ranks' DCP checkpoint part).
"""
from __future__ import annotations

import os
import pickle
import re

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from codraft.errors import CodraftError


class TensorFileError(CodraftError, ValueError):
    """A tensor file that cannot be read, or is refused (the message names it and says why)."""


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# torch's advice around a refusal: load unsafely, or allowlist the global
_ADVICE = ("Weights only load failed", "weights_only", "safe_globals", "documentation of torch.load")


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise TensorFileError(f"{path} cannot be loaded: not a valid safetensors file, truncated or corrupt "
                              f"({e})") from e


def load_pickle(path: str | os.PathLike):
    """torch.load of tensors and plain containers onto the CPU; never runs code from the file."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise refused(path, e) from e


def refused(where, e: Exception) -> TensorFileError:
    """The one-line error for a pickle ``where`` (a file, or an item in one) that failed to load with ``e``:
    a GLOBAL the loader would not import (code it would call) is named as such."""
    found = _GLOBAL.search(str(e)) if isinstance(e, pickle.UnpicklingError) else None
    if found:
        return TensorFileError(f"{where}: refused: it would run code when loaded (pickled GLOBAL "
                               f"'{found.group(1)}'); codraft loads only tensors and plain data")
    return TensorFileError(f"{where} cannot be loaded ({type(e).__name__}: {_reason(e)})")


def _reason(e: Exception) -> str:
    """The first line of torch's message that is not advice, up to its first sentence's end."""
    for line in str(e).splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if line and not any(a in line for a in _ADVICE):
            return line.split(". ")[0][:200]
    return "unreadable"
