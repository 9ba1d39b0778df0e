"""Draft models for speculative rollouts, built by kind through ``build_draft``.

Every kind implements ``codraft.drafts.base.Draft`` (see its docstring for the contract).
To add a kind, write ``codraft/drafts/<kind>.py`` with ``build(target_config, **options)``
and add one line to ``_BUILDERS``; modules are imported only when their kind is built.
"""
from __future__ import annotations

import importlib

from codraft.drafts.base import Draft, Features

# kind -> "module:function" of its builder, called as build(target_config, **options)
_BUILDERS: dict[str, str] = {
    "model": "codraft.drafts.model_draft:build",  # small independent decoder, own KV cache
    "ngram": "codraft.drafts.ngram:build",  # prompt lookup, deterministic
    "eagle3": "codraft.drafts.eagle3:build",  # EAGLE-3, training-time test over tapped features
    "dflash": "codraft.drafts.dflash:build",  # block diffusion conditioned on tapped features
    "dspark": "codraft.drafts.dspark:build",  # DFlash backbone + Markov head + confidence head
}


def available_drafts() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build_draft(kind: str, target_config, *, target=None, **options) -> Draft:
    """Build a draft of ``kind`` for a target with ``target_config`` (a ModelConfig).

    target: the policy module, for kinds that share its (frozen, detached) embedding and
    LM head; they get ``bind_target(embed, head)`` here. Without it, bind before use.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown draft kind {kind!r}; valid kinds: {', '.join(_BUILDERS)}")
    module, fn = _BUILDERS[kind].split(":")
    draft = getattr(importlib.import_module(module), fn)(target_config, **options)
    if target is not None:
        bind_target(draft, target)
    return draft


def bind_target(draft: Draft, target) -> Draft:
    """Point a draft that shares the policy's embedding / LM head at the live policy tensors."""
    if hasattr(draft, "bind_target"):
        draft.bind_target(target.embed_tokens.weight, target.head_weight)
    return draft


__all__ = ["Draft", "Features", "available_drafts", "bind_target", "build_draft"]
