"""The tensor-parallel plan (``codraft.parallel.tp``) read against the model it splits: which modules split
which way (with and without sequence parallelism), and which models cannot split at a degree (one line naming
the sizes)."""
from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel)

from codraft.models import ModelConfig, Transformer
from codraft.parallel import tp


def _config(**kw):
    return ModelConfig(**{**dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2), **kw})


def test_plan_splits_the_dense_products_and_leaves_moe_layers_whole():
    moe = _config(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  mlp_only_layers=[0])
    styles = tp.plan(Transformer(moe))
    assert isinstance(styles["embed_tokens"], RowwiseParallel) and isinstance(styles["lm_head"], ColwiseParallel)
    for i in range(3):
        assert all(isinstance(styles[f"layers.{i}.self_attn.{n}_proj"], ColwiseParallel) for n in "qkv")
        assert isinstance(styles[f"layers.{i}.self_attn.o_proj"], RowwiseParallel)
    assert {n for n in styles if ".mlp." in n} == {"layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
                                                   "layers.0.mlp.down_proj"}  # layers 1, 2: experts, whole
    tied = Transformer(_config(tie_word_embeddings=True))
    assert "lm_head" not in tp.plan(tied)  # tied: the embedding's split serves the head


def test_sequence_plan_splits_the_residual_stream_and_gathers_before_each_block():
    moe = _config(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                  mlp_only_layers=[0])
    styles = tp.plan(Transformer(moe), sequence=True)
    for i in range(3):
        assert all(isinstance(styles[f"layers.{i}.{n}"], SequenceParallel)
                   for n in ("input_layernorm", "post_attention_layernorm"))
        assert isinstance(styles[f"layers.{i}.self_attn"], PrepareModuleInput)
        assert styles[f"layers.{i}.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert isinstance(styles["layers.0.mlp"], PrepareModuleInput)  # dense: gathered, then split products
    assert isinstance(styles["layers.1.mlp"], PrepareModuleInputOutput)  # experts: gathered in, split out
    assert "norm" not in styles  # the final norm runs on the gathered rows the LM head reads
    assert not any(isinstance(v, (SequenceParallel, PrepareModuleInput)) for v in tp.plan(Transformer(moe)).values())


@pytest.mark.parametrize("degree,bad", [(2, None), (4, "num_key_value_heads=2"),
                                        (5, "num_attention_heads=4, num_key_value_heads=2, intermediate_size=24")])
def test_check_names_what_does_not_divide(degree, bad):
    message = tp.check(_config(), degree)
    if bad is None:
        assert message is None
    else:
        assert message == f"config key 'parallel.tp' must divide the policy's {bad}, got {degree}"


def test_a_moe_only_policy_need_not_divide_the_dense_size():
    c = _config(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                intermediate_size=7)
    assert tp.check(c, 2) is None and tp.check(dataclasses.replace(c, mlp_only_layers=[0]), 2) is not None
