"""Load and save the HF checkpoint format: config.json + *.safetensors (single or sharded).

Writes go to a temporary sibling folder that is renamed into place, so an interrupted
save never leaves a folder that looks complete.

Phi-3 checkpoints hold each layer's q/k/v projections as one ``qkv_proj`` and its gate/up projections as
one ``gate_up_proj``: split into codraft's (Llama's) names on load, fused back on save.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from codraft.atomic import atomic_dir
from codraft.models.config import ModelConfig
from codraft.models.tensor_files import load_safetensors
from codraft.models.transformer import Transformer

INDEX = "model.safetensors.index.json"


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def _our_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _split_fused(name: str, t: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A Phi-3 fused tensor -> its parts under codraft's names (rows: q, k, v; gate, up); others as they are."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        if t.shape[0] != q + 2 * kv:
            raise ValueError(f"tensor {name} has {t.shape[0]} rows, expected {q + 2 * kv} (q, k, v) from config.json")
        base = name[:-len("qkv_proj.weight")]
        return list(zip((base + "q_proj.weight", base + "k_proj.weight", base + "v_proj.weight"),
                        t.split([q, kv, kv])))
    if name.endswith("mlp.gate_up_proj.weight"):
        if t.shape[0] != 2 * config.intermediate_size:
            raise ValueError(f"tensor {name} has {t.shape[0]} rows, expected {2 * config.intermediate_size} "
                             "(gate, up) from config.json")
        base = name[:-len("gate_up_proj.weight")]
        return list(zip((base + "gate_proj.weight", base + "up_proj.weight"), t.chunk(2)))
    return [(name, t)]


def _fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """codraft's names -> Phi-3's fused qkv_proj and gate_up_proj, in the order of the state dict."""
    out = {}
    for name, t in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            base = name[:-len("q_proj.weight")]
            out[base + "qkv_proj.weight"] = torch.cat([t, state[base + "k_proj.weight"], state[base + "v_proj.weight"]])
        elif name.endswith("mlp.gate_proj.weight"):
            base = name[:-len("gate_proj.weight")]
            out[base + "gate_up_proj.weight"] = torch.cat([t, state[base + "up_proj.weight"]])
        elif not name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            out[name] = t
    return out


def hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A codraft state dict under the HF checkpoint's names (Phi-3: its fused projections), tensors as given:
    what ``save_pretrained`` writes and what a serving engine's in-place weight reload takes."""
    state = {_hf_name(k): v for k, v in state.items()}
    return _fused(state) if config.fused_projections else state


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{cfg} is missing: not an HF model folder")
    return ModelConfig.from_dict(json.loads(cfg.read_text()))


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"shard {f} listed in {path / INDEX} is missing")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return found


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Transformer:
    path = Path(path)
    config = read_config(path)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {_hf_name(k): v for k, v in model.state_dict().items()}
    state, unexpected = {}, []
    for f in _weight_files(path):
        tensors = load_safetensors(f)
        for fused in list(tensors):
            # popped: each file's tensors freed as they are converted (Phi-3's fused ones split first)
            parts = _split_fused(fused, tensors.pop(fused), config) if config.fused_projections \
                else [(fused, tensors.pop(fused))]
            for name, t in parts:
                if name not in expected:
                    if config.tie_word_embeddings and name == "lm_head.weight":
                        continue  # some exporters write the tied head anyway
                    unexpected.append(name)
                    continue
                if tuple(t.shape) != tuple(expected[name].shape):
                    if name.endswith("mlp.gate.weight"):  # a router: one row per expert
                        raise ValueError(f"checkpoint {path} has {t.shape[0]} experts ({name}), config.json says "
                                         f"num_experts={config.num_experts}")
                    raise ValueError(f"tensor {name} in {f.name} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(expected[name].shape)} from config.json")
                state[_our_name(name)] = t.to(dtype)
    missing = sorted(set(expected) - {_hf_name(k) for k in state})
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match config.json: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {sorted(unexpected)[:8]}{'...' if len(unexpected) > 8 else ''}")
    model.load_state_dict(state, assign=True)  # no random init of weights that get overwritten anyway
    model.rope_buffers()  # the non-persistent buffers: rebuild them off the meta device
    return model.to(device)


def save_pretrained(model: Transformer, path: str | os.PathLike, *, max_shard_bytes: int | None = None,
                    dtype: torch.dtype | None = None, extra_files: dict[str, str] | None = None):
    """Write config.json + weights (sharded above ``max_shard_bytes``) atomically.

    extra_files: name -> text written beside them (tokenizer.json, chat template, ...).
    """
    path = Path(path)
    state = hf_tensors({k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()},
                       model.config)
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "")
    cfg["architectures"] = list(model.config.architectures)
    with atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        total = sum(t.numel() * t.element_size() for t in state.values())
        if max_shard_bytes is None or total <= max_shard_bytes:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            return
        shards, cur, size = [], {}, 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > max_shard_bytes:
                shards.append(cur)
                cur, size = {}, 0
            cur[name] = t
            size += nbytes
        shards.append(cur)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
