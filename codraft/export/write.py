"""``export_draft``: a draft folder or run checkpoint in, a folder vLLM, SGLang and SpecForge load out.

Steps: refuse an output that would overwrite something (a non-empty folder without ``force``, a
file, the source itself or a folder around or inside it) or cannot be written (under a regular file,
a read-only or forbidden folder) before any work, in one line (``ExportError``); open the source
(source.py); build the kind's layout (eagle3.py, block.py); write ``config.json``,
``model.safetensors`` and the layout's extra files into a temporary sibling that is renamed into
place (``codraft.atomic``), so an interrupted export leaves no half-written folder under ``out``;
what the checks cannot foresee (a full disk, /proc) is an ``ExportError`` too.

The written ``config.json`` carries a ``codraft_export`` record (no stack reads it): the source,
the dtype, the taps in each stack's counting, the ``--stack`` asked for, the stacks that load the
folder as written (``stacks``; DSpark also per Markov head, ``markov_head``) and the notes on what a
stack does differently.

Not here: the command line (args.py, cli.py), reading an exported folder back (reader.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from codraft.atomic import atomic_dir
from codraft.errors import CodraftError
from codraft.export import block, eagle3
from codraft.export.layout import STACKS, dtype_name, parse_dtype
from codraft.export.source import EXPORT_MARK, open_source
from codraft.export.taps import vllm_ids

WEIGHTS = "model.safetensors"


class ExportError(CodraftError, ValueError):
    """``--out`` cannot take the export (one line: the path and why)."""


@dataclass
class Exported:
    path: Path
    kind: str
    dtype: str
    target_dir: Path        # the policy folder to serve next to the draft
    origin: str
    taps: dict[str, list[int]]  # layer_output / vllm_layer_input -> ids (taps.py)
    gamma: int              # tokens drafted per round as trained
    architecture: str = ""  # config.json's architectures[0]
    stack: str = "all"      # the --stack asked for
    stacks: list[str] = field(default_factory=lambda: list(STACKS))  # those loading the folder as written
    mask_token_id: int | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def export_draft(source: str | os.PathLike, out: str | os.PathLike, *, target: str | None = None,
                 dtype: str | torch.dtype = "float32", force: bool = False,
                 mask_token_id: int | None = None, stack: str = "all") -> Exported:
    """Export the draft in ``source`` (a draft folder, with ``target`` naming its policy, or a run
    checkpoint ``RUN_DIR/step_N``) to the folder ``out`` in ``dtype`` (float32, bfloat16, float16).

    force: replace a non-empty ``out``. mask_token_id: the token id MASK slots are fed as, for a
    DFlash / DSpark draft trained with a learned MASK vector (block.py). stack: the stack the folder is
    for (vllm, sglang, specforge), or all; only DSpark's folder (block.py) and a full-vocabulary EAGLE-3
    one (eagle3.py) differ."""
    if stack not in ("all", *STACKS):
        raise ValueError(f"unknown --stack {stack!r}; choose all, {', '.join(STACKS)}")
    dt = parse_dtype(dtype)
    out = Path(out)
    _check_out(out, Path(source), force)
    src = open_source(source, target)
    if src.kind == "eagle3":
        if mask_token_id is not None:
            raise ValueError("--mask-token-id applies to DFlash and DSpark drafts; EAGLE-3 has no MASK slots")
        lay = eagle3.layout(src.draft, src.target, dt, stack)
    else:
        lay = block.layout(src.draft, src.kind, src.target, dt, mask_token_id=mask_token_id, stack=stack)
    # the two countings of taps.py: codraft / SpecForge / DeepSpec / SGLang keys, and vLLM's top-level key
    taps = {"layer_output": lay.taps, "vllm_layer_input": vllm_ids(lay.taps)}
    lay.config[EXPORT_MARK] = {"format": 1, "kind": src.kind, "source": src.origin, "dtype": dtype_name(dt),
                               "target": str(src.target_dir), "taps": taps, "stack": stack, "stacks": lay.stacks,
                               **lay.record, "notes": lay.notes}
    try:
        with atomic_dir(out) as tmp:
            (tmp / "config.json").write_text(json.dumps(lay.config, indent=2) + "\n")
            save_file(lay.tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
            for name, obj in lay.extra.items():
                torch.save(obj, tmp / name)
            _plain_modes(tmp)
    except OSError as e:  # what _check_out cannot foresee: a full disk, /proc, a folder made read-only meanwhile
        raise ExportError(f"--out {str(out)!r} cannot be written (in {out.absolute().parent}): "
                          f"{e.strerror or e}") from e
    except SafetensorError as e:  # safetensors reports its write errors (a full disk) as its own type
        raise ExportError(f"--out {str(out)!r} cannot be written (in {out.absolute().parent}): {e}") from e
    return Exported(out, src.kind, dtype_name(dt), src.target_dir, src.origin, taps, lay.gamma,
                    lay.config["architectures"][0], stack, lay.stacks, lay.mask_token_id,
                    ["config.json", WEIGHTS, *lay.extra], lay.notes)


def _plain_modes(folder: Path) -> None:
    """The modes a plain mkdir / open would give (umask applied): the temporary folder is created
    private (0700) and safetensors writes 0600, but the export is handed to servers that may run as
    another user."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~mask)


def _check_out(out: Path, source: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a folder")
    _check_writable(out)
    o, s = out.resolve(), source.resolve()
    if o == s or s in o.parents or o in s.parents:
        raise ValueError(f"--out {str(out)!r} would overwrite or sit inside the source {str(source)!r}; "
                         "choose a separate folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {str(out)!r} exists and is not empty; pass --force to replace it")


def _check_writable(out: Path) -> None:
    """The export is built in a sibling of ``out`` and renamed into place: the nearest existing folder on the
    way to ``out`` must be a folder this process can write (creates nothing)."""
    near = out.absolute().parent
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise ExportError(f"--out {str(out)!r} cannot be created: {near} is a file, not a folder")
    if not os.access(near, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if os.statvfs(near).f_flag & os.ST_RDONLY else \
            "is not writable (permission denied)"
        raise ExportError(f"--out {str(out)!r} cannot be written: {near} {why}")
