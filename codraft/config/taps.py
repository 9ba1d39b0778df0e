"""``draft.taps``: the EAGLE-3 draft's tapped policy layers, checked against the draft kind and, where the
config can read it, the policy's depth (a named policy's depth: ``check_taps``, once it is loaded)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from codraft.drafts.eagle3_layer import SERVED_TAPS, parse_taps

if TYPE_CHECKING:
    from codraft.config.schema import RunConfig


class Taps:
    """``draft.taps``: auto, or distinct layer ids (``parse_taps``); the policy and kind: ``_taps_fit``."""

    def allows(self, v) -> bool:
        try:
            parse_taps(v)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return "auto or distinct layer ids >= 0, comma-separated (e.g. 2,5,8)"


def taps_problem(taps: str, kind: str, num_layers: int | None, *, key: str = "config key 'draft.taps'",
                 kind_key: str = "draft.kind=") -> str | None:
    """What is wrong with taps ``taps`` (valid ``parse_taps`` text) for a draft of ``kind`` on a policy of
    ``num_layers`` layers (None: not known yet, the range is left unchecked), or None. Only EAGLE-3 takes
    taps; it takes as many as the serving stacks build (SERVED_TAPS), each below the last layer, whose
    output no stack captures (codraft.export.taps). ``key``/``kind_key``: how messages name the settings."""
    layers = parse_taps(taps)
    if layers is None:
        return None
    if kind != "eagle3":
        return f"{key} must be auto with {kind_key}{kind} (it sets the EAGLE-3 draft's taps), got {taps!r}"
    if len(layers) != SERVED_TAPS:
        return f"{key} must name {SERVED_TAPS} layers with {kind_key}eagle3 (vLLM, SGLang and SpecForge build its " \
               f"fc for exactly {SERVED_TAPS} taps), got {taps!r}"
    if num_layers is not None and max(layers) > num_layers - 2:
        return f"{key} must be layer ids in [0, {num_layers - 2}] for the {num_layers}-layer policy (layer " \
               f"{num_layers - 1}'s output, the last, is no serving stack's tap), got {taps!r}"
    return None


def _policy_layers(init: str) -> int | None:
    """The layer count of a policy folder's config.json; None for a named policy (tiny-sft, smollm2-135m:
    built on first use) or an unreadable folder, left to the trainer (``check_taps``)."""
    if init in ("tiny-sft", "tiny-tools", "tiny-moe", "smollm2-135m"):
        return None
    try:
        return int(json.loads((Path(init) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _taps_fit(c: RunConfig) -> str | None:
    if c.draft.mode == "none" or c.draft.taps == "auto":
        return None
    return taps_problem(c.draft.taps, c.draft.kind, _policy_layers(c.policy.init))
