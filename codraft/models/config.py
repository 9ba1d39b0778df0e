"""ModelConfig: the decoder's hyper-parameters, named exactly as in HF `config.json`.

Covers the Llama and Qwen3 families (Qwen3 adds q/k RMSNorm) and their mixture-of-experts forms,
Qwen3-MoE and Qwen2-MoE (a shared expert; without attention biases). Unknown HF keys are ignored on
load; fields we do not model are not written back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
_ARCH_TO_TYPE = {a: t for t, a in _TYPE_TO_ARCH.items()}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
             "mlp_only_layers", "shared_expert_intermediate_size", "router_aux_loss_coef")


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
    # mixture of experts (Qwen3-MoE; Qwen2-MoE adds a shared expert): layer i is sparse when num_experts > 0,
    # i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (codraft.models.moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001  # HF's; the trainer's is grpo.router_aux_coef
    qkv_bias: bool = False  # Qwen2-MoE's q/k/v biases: not modelled, refused

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        arch = self.architectures[0] if self.architectures else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if arch in MOE_ARCHITECTURES:
            self._check_experts(arch)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    def _check_experts(self, arch: str):
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{arch}: need num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got "
                             f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(f"{arch}: need moe_intermediate_size >= 1 and decoder_sparse_step >= 1, got "
                             f"{self.moe_intermediate_size}, {self.decoder_sparse_step}")
        if self.qkv_bias:
            raise ValueError(f"{arch} with qkv_bias=true: attention biases are not modelled (only qkv_bias=false)")
        if arch == "Qwen3MoeForCausalLM" and self.shared_expert_intermediate_size:
            raise ValueError("Qwen3MoeForCausalLM has no shared expert: shared_expert_intermediate_size must be 0 "
                             "(Qwen2MoeForCausalLM has one)")

    @property
    def moe(self) -> bool:
        return self.architectures[0] in MOE_ARCHITECTURES

    def sparse_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` is a mixture of experts (HF's rule)."""
        return self.moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def qk_norm(self) -> bool:
        return self.architectures[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

    @property
    def model_type(self) -> str:
        return _ARCH_TO_TYPE[self.architectures[0]]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters
        rope = dict(d.pop("rope_parameters", None) or {})
        if "rope_theta" in rope:
            d.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            d.setdefault("rope_scaling", rope)
        if "num_local_experts" in d:  # transformers >= 5 writes num_experts under this name
            d.setdefault("num_experts", d.pop("num_local_experts"))
        if not d.get("architectures") and d.get("model_type") in _TYPE_TO_ARCH:
            d["architectures"] = [_TYPE_TO_ARCH[d["model_type"]]]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """HF-style dict, readable by transformers 4.x (rope_scaling) and 5.x (rope_parameters)."""
        d = dataclasses.asdict(self)
        if not self.moe:  # a dense model's config.json as before
            for k in (*_MOE_KEYS, "qkv_bias"):
                d.pop(k)
        elif self.model_type != "qwen2_moe":
            d.pop("qkv_bias")
        d["model_type"] = self.model_type
        d["hidden_act"] = "silu"
        d["rope_parameters"] = {"rope_theta": self.rope_theta,
                                **(self.rope_scaling or {"rope_type": "default"})}
        if self.rope_scaling is None:
            d.pop("rope_scaling")
        return d
