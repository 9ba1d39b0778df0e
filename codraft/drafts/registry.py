"""One row per draft kind, and the factory everything gets its drafts from.

A row names the builder (random init, ``build(target_config, *, gamma=None, **options)``), the
class (which ``load``s a saved folder and lists the ``architectures`` its config.json carries),
and which of the options shared across kinds it takes beyond ``gamma`` (tokens drafted per
round, one spelling for every kind). ``init_draft`` and ``load_draft`` return a draft bound to
its target, on the target's device, with the CPU decode fast path installed (``codraft.kernels``); the config, the CLI and the benchmarks read the list of
kinds from ``available_drafts()``.

Not here: offline training of a draft's initial weights (``codraft.train.offline_draft``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from codraft import kernels
from codraft.drafts import dflash, dspark, eagle3, model_draft, ngram
from codraft.drafts.base import Draft


@dataclass(frozen=True)
class DraftKind:
    build: Callable[..., Draft]     # build(target_config, *, gamma=None, **options) -> random init
    cls: type[Draft]                # cls.load(path, target_config, *, gamma=None, **options); cls.architectures
    options: tuple[str, ...] = ()   # shared options it takes beyond gamma; the others are ignored
    doc: str = ""

    @property
    def has_weights(self) -> bool:
        """Whether drafts of this kind have weights to train (and save)."""
        return issubclass(self.cls, torch.nn.Module)


KINDS: dict[str, DraftKind] = {
    "eagle3": DraftKind(eagle3.build, eagle3.Eagle3Draft, ("layers",),  # layers: the taps (draft.taps)
                        doc="EAGLE-3, training-time test over tapped features"),
    "dflash": DraftKind(dflash.build, dflash.DFlashDraft, ("num_anchors",),
                        doc="block diffusion conditioned on tapped features"),
    "dspark": DraftKind(dspark.build, dspark.DSparkDraft, ("num_anchors",),
                        doc="DFlash backbone + Markov head + confidence head"),
    "model": DraftKind(model_draft.build, model_draft.ModelDraft, doc="small independent decoder, own KV cache"),
    "ngram": DraftKind(ngram.build, ngram.NgramDraft, doc="prompt lookup, deterministic, no weights"),
}


def available_drafts() -> tuple[str, ...]:
    return tuple(KINDS)


def draft_kind(kind: str) -> DraftKind:
    if kind not in KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    return KINDS[kind]


def build_draft(kind: str, target_config, *, target=None, **options) -> Draft:
    """A randomly initialised draft of ``kind`` for ``target_config`` (seed with torch.manual_seed).

    options go to the kind's builder as they are; target: the policy module, which the draft is
    bound to (kinds sharing its embedding / LM head) and moved next to.
    """
    draft = draft_kind(kind).build(target_config, **options)
    return _attach(draft, target) if target is not None else draft


def saved_kind(path: str | os.PathLike) -> str:
    """The kind of the draft saved in the folder ``path``, from its config.json's architecture."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"draft folder {str(path)!r} has no config.json")
    arch = (json.loads(cfg.read_text()).get("architectures") or [None])[0]
    for kind, row in KINDS.items():
        if arch in row.cls.architectures:
            return kind
    known = [a for row in KINDS.values() for a in row.cls.architectures]
    raise ValueError(f"{path}: unknown draft architecture {arch!r}; known: {', '.join(known)}")


def load_draft(path: str | os.PathLike, target, *, gamma: int | None = None, **options) -> Draft:
    """The draft saved in ``path`` (any kind), checked against and bound to ``target``."""
    row = KINDS[saved_kind(path)]
    return _attach(row.cls.load(path, target.config, gamma=gamma, **_shared(row, options)), target)


def init_draft(kind: str, target, *, init: str | os.PathLike = "random", gamma: int | None = None,
               **options) -> Draft:
    """The draft a run starts from: ``init`` "random" or a folder saved by a draft of ``kind``.

    options: shared options (``num_anchors``, ``layers``; 0/None = the draft's own), passed to the
    kinds that take them and ignored by the others."""
    row = draft_kind(kind)
    if str(init) == "random":
        return _attach(row.build(target.config, gamma=gamma, **_shared(row, options)), target)
    found = saved_kind(init)
    if found != kind:
        raise ValueError(f"draft folder {str(init)!r} holds a {found} draft, not {kind}")
    return load_draft(init, target, gamma=gamma, **options)


def _shared(row: DraftKind, options: dict) -> dict:
    return {k: v for k, v in options.items() if k in row.options and v}


def _attach(draft: Draft, target) -> Draft:
    """Bind to the target's embedding / head, move next to it, install the CPU decode fast path."""
    draft.bind_target(target.embed_tokens.weight, target.head_weight)
    if isinstance(draft, torch.nn.Module):
        draft.to(target.embed_tokens.weight.device)
    return kernels.enable(draft)
