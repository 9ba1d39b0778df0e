"""``load_exported``: an exported folder read back into a codraft draft, bound to its target.

The inverse of the export, used to check it (exported then read back, the draft proposes what the
original did) and to run an exported folder with codraft's own engine:

* EAGLE-3: codraft's loader already reads the public layout (``codraft.drafts.load_draft``); the
  shipped ``embed_tokens.weight`` is ignored, the target's is bound.
* DFlash / DSpark: the config is rebuilt from the public keys (``dflash_config``, ``block_size``,
  the DSpark head keys) and the ``codraft`` training settings; DSpark head names are mapped back;
  a ``mask_embedding.pt`` restores the learned MASK vector; DSpark's shipped ``embed_tokens`` /
  ``lm_head`` copies are dropped (the target's are bound).

Not here: folders written by other trainers (their training settings are unknown; only
codraft-exported folders are read).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from codraft import kernels
from codraft.drafts import Draft, load_draft
from codraft.drafts.block_backbone import BlockDraftConfig, check_target
from codraft.drafts.dflash import DFlashDraft
from codraft.drafts.dspark import DSparkDraft
from codraft.export.block import ARCHITECTURES, MASK_FILE, SERVING_DSPARK, codraft_name
from codraft.export.source import EXPORT_MARK
from codraft.models.tensor_files import load_pickle, load_safetensors

_KINDS = {**{arch: kind for kind, arch in ARCHITECTURES.items()}, SERVING_DSPARK: "dspark"}  # --stack sglang


def load_exported(path: str | os.PathLike, target, *, dtype: torch.dtype | None = None) -> Draft:
    """The draft in the exported folder ``path``, checked against and bound to ``target``.

    dtype: the draft's parameter dtype; None = the folder's ``torch_dtype``."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json")
    d = json.loads(cfg_file.read_text())
    if EXPORT_MARK not in d:
        raise ValueError(f"{path} was not written by codraft's export-draft (no {EXPORT_MARK!r} record)")
    arch = (d.get("architectures") or [None])[0]
    if arch not in _KINDS:
        draft = load_draft(path, target)  # EAGLE-3: codraft's own loader reads the public layout
        return draft if dtype is None else draft.to(dtype)
    kind, dc, extra = _KINDS[arch], d["dflash_config"], d.get("codraft", {})
    learned = (path / MASK_FILE).is_file()
    config = BlockDraftConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_key_value_heads"], head_dim=d["head_dim"], rope_theta=d["rope_theta"],
        rope_scaling=d.get("rope_scaling"), rms_norm_eps=d["rms_norm_eps"],
        max_position_embeddings=d["max_position_embeddings"], target_hidden_size=d["target_hidden_size"],
        num_target_layers=d["num_target_layers"], target_layer_ids=list(dc["target_layer_ids"]),
        block_size=d["block_size"], mask_token_id=None if learned else dc["mask_token_id"],
        **{k: extra[k] for k in ("loss_decay", "num_anchors", "loss_chunk_blocks") if k in extra})
    check_target(config, target.config, path)
    if kind == "dflash":
        draft = DFlashDraft(config)
    else:
        draft = DSparkDraft(config, markov=d["markov_head_type"], markov_rank=d["markov_rank"],
                            **{k: extra[k] for k in ("ce_weight", "tv_weight", "conf_weight") if k in extra})
    tensors = {codraft_name(k): v for k, v in load_safetensors(path / "model.safetensors").items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    if learned:
        tensors["mask_embedding"] = load_pickle(path / MASK_FILE)["embedding"]
    want = draft.state_dict()
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
    draft = draft.to(dtype or getattr(torch, d.get("torch_dtype", "float32")))
    draft.load_state_dict(tensors)
    if "default_gamma" in extra:
        draft.default_gamma = extra["default_gamma"]
    draft.bind_target(target.embed_tokens.weight, target.head_weight).to(target.embed_tokens.weight.device)
    return kernels.enable(draft.eval())
