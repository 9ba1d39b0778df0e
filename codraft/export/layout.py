"""``Layout``: what one exported folder holds before it is written, and the dtype rules for its tensors.

Floating tensors take the requested dtype; integer and boolean ones (``d2t``, ``t2d``) keep theirs,
since the stacks read them as ids and masks. Not here: which tensors a kind writes (eagle3.py, block.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

STACKS = ("vllm", "sglang", "specforge")  # the loaders an export is written for (docs/serving.md)
STACK_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "specforge": "SpecForge"}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype) and name in DTYPES.values():
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported export dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A detached, contiguous CPU copy; floating point in ``dtype``, ids and masks unchanged."""
    t = t.detach().to("cpu")
    return (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()


@dataclass
class Layout:
    config: dict                        # config.json
    tensors: dict[str, torch.Tensor]    # model.safetensors, public names, final dtypes
    extra: dict[str, object] = field(default_factory=dict)  # other files: name -> object for torch.save
    taps: list[int] = field(default_factory=list)           # exported taps (output-of-layer ids, ascending)
    gamma: int = 0                      # tokens drafted per round as trained (block drafts: from block_size)
    mask_token_id: int | None = None
    notes: list[str] = field(default_factory=list)          # what the stacks do differently, for the user
    stacks: list[str] = field(default_factory=lambda: list(STACKS))  # those that load the folder as written
    record: dict = field(default_factory=dict)              # more of the codraft_export record (DSpark: heads)
