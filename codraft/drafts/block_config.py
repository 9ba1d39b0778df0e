"""A block draft's configuration and its saved form: what defines its weights and behaviour
(``BlockDraftConfig``, saved as config.json), the config for a target (``make_config``, with the
default tapped layers ``build_target_layer_ids``), and reading a saved draft back (``read_saved``,
``config_from_dict``, ``check_target`` against the target it is loaded for).

Not here: the module and its ``save`` (block_backbone.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from codraft.models.config import ModelConfig
from codraft.models.tensor_files import load_safetensors


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped target layers (0-based layer outputs), DFlash's rule (notes 2.1).

    K = 1: [L // 2]; K > 1: round(1 + i·(L − 4)/(K − 1)), e.g. L=36, K=5 → [1, 9, 17, 25, 33].
    Small targets where that rule leaves [0, L) or repeats a layer get K evenly spaced layers.
    """
    n, k = num_target_layers, num_draft_layers
    if k < 1 or n < 1:
        raise ValueError(f"need >= 1 target and draft layer, got num_target_layers={n}, num_draft_layers={k}")
    if k == 1:
        return [n // 2]
    ids = [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]
    if len(set(ids)) == k and all(0 <= i < n for i in ids):
        return ids
    if k > n:
        raise ValueError(f"cannot tap {k} distinct layers of a {n}-layer target; pass layers=[...] explicitly")
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


@dataclasses.dataclass(kw_only=True)
class BlockDraftConfig:
    """Everything that defines a block draft's weights and behaviour (saved as config.json)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    target_hidden_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int | None = None  # None: a learned mask embedding
    loss_decay: float = 7.0
    num_anchors: int = 128  # per packed sequence and step
    loss_chunk_blocks: int = 256  # head + loss run over this many blocks at a time (``chunked``)
    draft_vocab_size: int = 0  # K > 0: the draft predicts only K target tokens (``set_vocabulary``); 0: all

    def layer_config(self) -> ModelConfig:
        """The Qwen3-style decoder config of one draft layer (q/k norm, GQA, SwiGLU)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, architectures=["Qwen3ForCausalLM"])


_LAYER_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
               "rope_scaling", "rms_norm_eps", "max_position_embeddings")


def make_config(target: ModelConfig, *, num_layers: int, block_size: int, layers, mask_token_id,
                decay: float, num_anchors: int, loss_chunk_blocks: int, overrides: dict,
                draft_vocab_size: int = 0) -> BlockDraftConfig:
    """The draft config for ``target``: its widths, K layers, tapped layers, with ``overrides``."""
    bad = set(overrides) - set(_LAYER_KEYS)
    if bad:
        raise ValueError(f"unknown block-draft options {sorted(bad)}; layer overrides allowed: {list(_LAYER_KEYS)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = list(layers) if layers is not None else build_target_layer_ids(target.num_hidden_layers, num_layers)
    if not ids or any(not 0 <= i < target.num_hidden_layers for i in ids):
        raise ValueError(f"target layer ids {ids} must lie in [0, {target.num_hidden_layers})")
    if mask_token_id is not None and not 0 <= mask_token_id < target.vocab_size:
        raise ValueError(f"mask_token_id={mask_token_id} outside the target vocabulary [0, {target.vocab_size})")
    if not 0 <= draft_vocab_size <= target.vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: 0 (the whole vocabulary) or 1..{target.vocab_size}")
    base = {k: getattr(target, k) for k in _LAYER_KEYS}
    if {"num_attention_heads"} & overrides.keys():  # re-derive dependent widths unless given
        base["head_dim"] = target.hidden_size // overrides["num_attention_heads"]
        base["num_key_value_heads"] = overrides["num_attention_heads"]
    base.update(overrides)
    return BlockDraftConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_hidden_layers=num_layers,
        target_hidden_size=target.hidden_size, num_target_layers=target.num_hidden_layers,
        target_layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id, loss_decay=float(decay),
        num_anchors=num_anchors, loss_chunk_blocks=loss_chunk_blocks, draft_vocab_size=draft_vocab_size, **base)


def read_saved(path: str | os.PathLike, architecture: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a saved block draft; checks the architecture name."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a saved draft (needs config.json and model.safetensors)")
    d = json.loads((path / "config.json").read_text())
    arch = (d.get("architectures") or [None])[0]
    if arch != architecture:
        raise ValueError(f"{str(path)!r} holds a {arch!r} draft, expected {architecture!r}")
    return d, load_safetensors(path / "model.safetensors")


def config_from_dict(d: dict, num_anchors: int | None = None) -> BlockDraftConfig:
    """The saved config; ``num_anchors`` (blocks per sequence in the loss, its cost) may be changed."""
    names = {f.name for f in dataclasses.fields(BlockDraftConfig)}
    config = BlockDraftConfig(**{k: v for k, v in d.items() if k in names})
    return config if not num_anchors else dataclasses.replace(config, num_anchors=num_anchors)


def check_target(config: BlockDraftConfig, target: ModelConfig | None, where: Any) -> None:
    if target is None:
        return
    if (config.vocab_size, config.hidden_size) != (target.vocab_size, target.hidden_size):
        raise ValueError(f"draft {where} has vocab_size={config.vocab_size}, hidden_size={config.hidden_size}; "
                         f"target has {target.vocab_size}, {target.hidden_size}")
    if max(config.target_layer_ids) >= target.num_hidden_layers:
        raise ValueError(f"draft {where} taps layers {config.target_layer_ids}, target has "
                         f"{target.num_hidden_layers} layers")


__all__ = ["BlockDraftConfig", "build_target_layer_ids", "make_config", "read_saved", "config_from_dict",
           "check_target"]
