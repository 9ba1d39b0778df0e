"""ModelConfig: the decoder's hyper-parameters, named exactly as in HF `config.json`.

Covers the Llama and Qwen3 families (Qwen3 adds q/k RMSNorm). Unknown HF keys are
ignored on load; fields we do not model are not written back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        arch = self.architectures[0] if self.architectures else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    @property
    def qk_norm(self) -> bool:
        return self.architectures[0] == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[self.architectures[0]]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope = dict(d.pop("rope_parameters", None) or {})
        if "rope_theta" in rope:
            d.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            d.setdefault("rope_scaling", rope)
        if not d.get("architectures") and d.get("model_type") in _TYPE_TO_ARCH:
            d["architectures"] = [_TYPE_TO_ARCH[d["model_type"]]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """HF-style dict, readable by transformers 4.x (rope_scaling) and 5.x (rope_parameters)."""
        d = dataclasses.asdict(self)
        d["model_type"] = self.model_type
        d["hidden_act"] = "silu"
        d["rope_parameters"] = {"rope_theta": self.rope_theta,
                                **(self.rope_scaling or {"rope_type": "default"})}
        if self.rope_scaling is None:
            d.pop("rope_scaling")
        return d
