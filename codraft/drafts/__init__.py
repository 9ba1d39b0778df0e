"""Draft models for speculative rollouts: the interface (``Draft``), one registry row per kind,
and the factory (``build_draft``, ``init_draft``, ``load_draft``).

Every kind implements ``codraft.drafts.base.Draft`` (see its docstring for the contract); the
kinds and their options are listed in ``codraft.drafts.registry.KINDS``.
"""
from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.drafts.registry import (KINDS, available_drafts, build_draft, draft_kind, init_draft, load_draft,
                                     saved_kind)

__all__ = ["Draft", "DraftBatch", "Features", "KINDS", "available_drafts", "build_draft", "draft_kind",
           "init_draft", "load_draft", "saved_kind"]
