"""What an export starts from: a saved draft folder (with the policy it was trained for), or a run checkpoint.

``open_source(path, target=None)`` returns the draft, bound to and checked against its target, and
the target itself (the export ships some of the target's tensors and names its folder):

* a draft folder (``config.json`` whose architecture is a codraft draft kind, as ``save`` and
  ``codraft train-draft`` write it): ``target`` names the policy it was trained for (tiny-sft,
  smollm2-135m or an HF folder); a ``target.json`` record beside the draft is checked against it;
* a run checkpoint ``RUN_DIR/step_N`` (``codraft.train.checkpoint``): verified against its marker's
  sizes and checksums; the target is its ``policy/`` (the RL-trained policy) and the draft is rebuilt
  from ``config.yaml`` (kind, gamma, taps, and the folder it started from, if any) and filled from
  ``draft.pt``. A run folder itself is refused with the name of its newest checkpoint.

Not here: the public layouts (eagle3.py, block.py), writing (write.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from codraft.drafts import Draft, draft_kind, init_draft, load_draft
from codraft.drafts.eagle3_layer import parse_taps
from codraft.drafts.registry import saved_kind
from codraft.models import load_pretrained
from codraft.policy.resolve import resolve_policy_dir
from codraft.train import checkpoint as ckpt
from codraft.train.offline_draft import check_target_record

EXPORTABLE = ("eagle3", "dflash", "dspark")  # kinds with a public serving layout
EXPORT_MARK = "codraft_export"  # config.json key of an exported folder (write.py writes it)


@dataclass
class Source:
    draft: Draft            # bound to ``target``, on its device
    kind: str               # a key of EXPORTABLE
    target: torch.nn.Module  # the policy the draft serves with (codraft Transformer)
    target_dir: Path         # its HF-format folder (what vLLM / SGLang serve)
    origin: str              # where the draft came from, for the record


def open_source(path: str | os.PathLike, target: str | None = None) -> Source:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is a file: give a draft folder or a run checkpoint folder (RUN_DIR/step_N)")
    # each kind by the file only it has: a checkpoint its marker, a draft folder its config.json (a
    # checkpoint's is policy/config.json); a stray draft.pt or policy/ beside a draft makes no checkpoint
    is_checkpoint, is_draft = (path / ckpt.MARKER).is_file(), (path / "config.json").is_file()
    if is_checkpoint and is_draft:
        raise ValueError(f"{str(path)!r} has both a run checkpoint's {ckpt.MARKER} and a draft folder's "
                         "config.json, so which it is cannot be told; remove the file that does not belong")
    if is_checkpoint:
        if target is not None:
            raise ValueError(f"--target {target!r} with a run checkpoint: the checkpoint carries the policy its "
                             f"draft was co-trained with ({path / 'policy'}); drop --target")
        return _from_checkpoint(path)
    if is_draft:
        return _from_draft_folder(path, target)
    steps = ckpt.list_checkpoints(path)
    if steps:
        raise ValueError(f"{str(path)!r} is a run folder; export one of its checkpoints, e.g. the newest: {steps[-1]}")
    raise ValueError(f"{str(path)!r} is neither a draft folder (config.json) nor a run checkpoint (state.json)")


def _exportable(kind: str, where: Path) -> None:
    if kind not in EXPORTABLE:
        raise ValueError(f"{where} holds a {kind!r} draft; only {', '.join(EXPORTABLE)} drafts have a layout "
                         f"that vLLM, SGLang and SpecForge load")


def _from_draft_folder(path: Path, target: str | None) -> Source:
    if EXPORT_MARK in json.loads((path / "config.json").read_text()):
        raise ValueError(f"{path} is already an exported folder (written by export-draft); export the draft it "
                         "came from")
    kind = saved_kind(path)
    _exportable(kind, path)
    if target is None:
        raise ValueError(f"--target is needed for the draft folder {path}: the export carries tensors of the policy "
                         "the draft was trained for (its token embedding, and its layer count for the taps); name "
                         "it (tiny-sft, smollm2-135m or an HF folder)")
    policy_dir = resolve_policy_dir(target)
    policy = load_pretrained(policy_dir)  # the weights only: the export needs no tokenizer
    draft = load_draft(path, policy)
    check_target_record(path, policy, policy_dir, draft.feature_layers)
    return Source(draft, kind, policy, policy_dir, f"draft folder {path}")


def _from_checkpoint(path: Path) -> Source:
    problem = ckpt.verify(path)
    if problem is not None:
        raise ckpt.CheckpointError(f"{path} is not a complete run checkpoint: {problem}")
    config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    d = config.get("draft") or {}
    if d.get("mode") == "none" or not (path / "draft.pt").is_file():
        raise ValueError(f"checkpoint {path} has no draft to export (draft.mode={d.get('mode')!r})")
    kind = str(d.get("kind"))
    draft_kind(kind)  # an unknown kind: one line listing the valid ones
    _exportable(kind, path)
    policy = ckpt.load_policy_from(path)
    draft = checkpoint_draft(path, d, policy)
    step = json.loads((path / ckpt.MARKER).read_text())["step"]
    return Source(draft, kind, policy, path / "policy", f"checkpoint {path} (step {step})")


def checkpoint_draft(path: Path, d: dict, policy) -> Draft:
    """The co-trained draft of checkpoint ``path`` (``d``: its config.yaml's draft section), rebuilt as the run
    built it and filled from ``draft.pt``, bound to ``policy`` (also what ``codraft eval`` decodes with)."""
    kind = str(d.get("kind"))
    state = ckpt.load_file(path / "draft.pt")
    draft = _rebuild(kind, d, policy, path)
    want = draft.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    shapes = [f"{k} {tuple(state[k].shape)} != {tuple(want[k].shape)}" for k in set(want) & set(state)
              if state[k].shape != want[k].shape]
    if missing or unexpected or shapes:
        raise ValueError(f"{path / 'draft.pt'} does not fit the {kind} draft its config.yaml describes (gamma="
                         f"{d.get('gamma')}, taps={d.get('taps', 'auto')}, init={d.get('init')!r}): missing {missing}, "
                         f"unexpected {unexpected}, shapes {sorted(shapes)}")
    draft.load_state_dict(state)
    return draft


def _rebuild(kind: str, d: dict, policy, path: Path) -> Draft:
    """The draft's architecture as the run built it: from the folder it started from, else the kind's
    defaults for the run's gamma and taps ("random" and "offline" starts are both built that way)."""
    init = str(d.get("init", "random"))
    # draft.taps: EAGLE-3's chosen layers (a config.yaml from before the key has none: auto)
    options = {"num_anchors": d.get("num_anchors") or 0, "layers": parse_taps(str(d.get("taps", "auto")))}
    if init not in ("random", "offline") and not Path(init).is_dir():
        raise ValueError(f"checkpoint {path}: the run started its draft from {init!r}, which is gone, so the "
                         "draft's shape (taps, vocabulary, layers) cannot be rebuilt; restore that folder")
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; leave the caller's RNG alone
        return init_draft(kind, policy, init="random" if init == "offline" else init, gamma=d.get("gamma"), **options)
