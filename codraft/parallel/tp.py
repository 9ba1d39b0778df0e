"""Tensor parallelism (``parallel.tp``): the policy's products split over the tp ranks by DTensor
``parallelize_module`` plans, applied from outside the model (Megatron's layout, torchtitan's manner).

Per dense decoder layer: q/k/v and the MLP's gate/up column-wise (each rank holds its heads' rows and its
share of the intermediate ones, so attention runs on its heads alone), o and down row-wise (their partial
sums all-reduced). The token embedding is vocabulary-parallel (each rank its rows; an id outside them adds
zeros, the ranks' sums all-reduced). The LM head is vocabulary-parallel too: the logits stay split over the
ranks (a DTensor sharded on the vocabulary) and the GRPO loss's logprobs and entropy come from the shards
with all-reduces of a few numbers per row (``token_logprobs``, ``mean_entropy``): the policy's full logits are
never on one rank. The co-trained draft's teacher rows are the exception: gathered whole, detached,
since the draft (replicated over tp) reads every column of them.

Replicated over tp: the norms and the residual stream between blocks (no sequence parallelism, so the taps
are whole on every rank and the draft trains on them as in one process), and MoE layers (router and experts
run whole on every tp rank). Their gradients are the same on every tp rank (what reaches them is
all-reduced), so the ranks apply the same update to them. The q/k norms (Qwen3, Gemma 3) are replicated too
but run on each rank's heads: their gradients are summed over tp by a hook. Needs heads, KV heads and the
dense MLP's intermediate size divisible by tp (``check``); the vocabulary may split unevenly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from codraft.models.layers import MLP


def check(config, tp: int) -> str | None:
    """Why ``config``'s model cannot split over ``tp`` ranks (None: it can)."""
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    if not all(config.sparse_layer(i) for i in range(config.num_hidden_layers)):  # (a MoE layer stays whole)
        sizes["intermediate_size"] = config.intermediate_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    return None if not bad else f"config key 'parallel.tp' must divide the policy's {', '.join(bad)}, got {tp}"


def plan(policy: nn.Module, sequence: bool = False) -> dict:
    """Module name -> its ``ParallelStyle`` (see the module doc); ``sequence``: sequence parallelism."""
    seq = Shard(1) if sequence else Replicate()  # the residual stream between blocks
    styles = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                              use_local_output=not sequence)}
    if policy.lm_head is not None:  # (never called as a module: ``Transformer.logits`` reads its weight, split)
        styles["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for i, layer in enumerate(policy.layers):
        at = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            styles[f"{at}.self_attn.{name}"] = ColwiseParallel()
        styles[f"{at}.self_attn.o_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=not sequence)
        dense = type(layer.mlp) is MLP  # (a MoE layer stays whole)
        if dense:
            styles[f"{at}.mlp.gate_proj"] = ColwiseParallel()
            styles[f"{at}.mlp.up_proj"] = ColwiseParallel()
            styles[f"{at}.mlp.down_proj"] = RowwiseParallel(output_layouts=seq, use_local_output=not sequence)
        if sequence:
            styles.update(_sequence_styles(layer, at, dense))
    return styles


def _sequence_styles(layer: nn.Module, at: str, dense: bool) -> dict:
    """A decoder layer's norms split along the sequence, and its attention and MLP gathering it first (the
    attention's other inputs, RoPE tables to KV cache, pass as they are)."""
    styles = {f"{at}.{name}": SequenceParallel() for name in ("input_layernorm", "post_attention_layernorm",
                                                              "pre_feedforward_layernorm", "post_feedforward_layernorm")
              if hasattr(layer, name)}
    styles[f"{at}.self_attn"] = PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * 8,
                                                   desired_input_layouts=(Replicate(),) + (None,) * 8)
    if dense:
        styles[f"{at}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    else:  # the experts run whole: gathered in, split again out
        styles[f"{at}.mlp"] = PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                       use_local_input=True, output_layouts=(Replicate(),),
                                                       desired_output_layouts=(Shard(1),), use_local_output=False)
    return styles


def parallelize_tp(policy: nn.Module, mesh: DeviceMesh, sequence: bool = False) -> nn.Module:
    """Apply ``plan(policy, sequence)`` over the 1-D ``mesh`` (the tp dimension) in place."""
    why = check(policy.config, mesh.size())
    if why:
        raise ValueError(why)
    _reference_forwards(policy)
    parallelize_module(policy, mesh, plan(policy, sequence))
    for layer in policy.layers:  # q/k norms (Qwen3, Gemma 3) run on this rank's heads: their gradients are shares
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if norm is not None:
                norm.weight.register_hook(_summed_over(mesh.get_group()))
    for p in policy.parameters():
        if isinstance(p, DTensor):
            p.register_post_accumulate_grad_hook(_grad_as_param)
    return policy


def split_over_tp(t: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter or its gradient) is sharded over a ``tp`` mesh dimension: its local squares
    are a share of its norm's."""
    return isinstance(t, DTensor) and any(
        name == "tp" and p.is_shard() for name, p in zip(t.device_mesh.mesh_dim_names or (), t.placements))


def _grad_as_param(p: torch.Tensor) -> None:
    """A split parameter's gradient, once accumulated, in the parameter's placements: the vocabulary-parallel
    embedding's backward leaves a replicated (whole) one where its weight is split (slicing it is local), which
    would hold the whole vocabulary's gradient on every rank."""
    if p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _reference_forwards(policy: nn.Module) -> None:
    """The split policy runs the models' own forwards: the CPU decode path (``codraft.kernels``, installed as
    subclasses) reads weights whole and bypasses the projection modules; the engine decodes from its own
    whole copy (``codraft.rollout.weights``)."""
    for m in policy.modules():
        if type(m).__module__.startswith("codraft.kernels"):
            m.__class__ = type(m).__mro__[1]


def _summed_over(group):
    """A gradient hook: the sum of the ranks' gradients (each computed from its share of the heads)."""
    def hook(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad
    return hook


class _SplitLogprobs(torch.autograd.Function):
    """log softmax(z)[id] from this rank's vocabulary columns z (R, V_r) starting at ``first``; the gradient
    (one-hot − softmax on this rank's columns) needs no communication."""

    @staticmethod
    def forward(ctx, z, ids, first: int, group):
        z = z.float()
        top = z.max(-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        e = (z - top[:, None]).exp()
        total = e.sum(-1)
        dist.all_reduce(total, group=group)
        col = ids - first
        here = (col >= 0) & (col < z.shape[-1])
        col = col.clamp(0, z.shape[-1] - 1)
        picked = torch.where(here, z.gather(-1, col[:, None]).squeeze(-1), 0.0)
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(e / total[:, None], col, here)
        return picked - top - total.log()

    @staticmethod
    def backward(ctx, grad):
        p, col, here = ctx.saved_tensors
        g = -p * grad[:, None]
        g.scatter_add_(-1, col[:, None], (grad * here)[:, None])
        return g, None, None, None


def _shard(logits: DTensor) -> tuple[torch.Tensor, int, dist.ProcessGroup]:
    """This rank's columns of vocabulary-split logits, the first column's index and the group."""
    split = logits.placements[-1]
    if not (split.is_shard() and split.dim % logits.dim() == logits.dim() - 1):
        raise ValueError(f"vocabulary-parallel logits must be sharded on the last dimension, got {logits.placements}")
    mesh = logits.device_mesh
    width = -(-logits.shape[-1] // mesh.size(-1))  # DTensor's shards: torch.chunk's, the last may be shorter
    return logits.to_local(), width * mesh.get_local_rank(mesh.ndim - 1), mesh.get_group(mesh.ndim - 1)


def token_logprobs(logits: DTensor, ids: torch.Tensor) -> torch.Tensor:
    """logits (R, V) split on the vocabulary, ids (R,) -> log softmax(logits)[ids] (R,), fp32, the same on every
    rank, differentiable (the gradient reaches each rank's columns)."""
    z, first, group = _shard(logits)
    return _SplitLogprobs.apply(z, ids, first, group)


@torch.no_grad()
def mean_entropy(logits: DTensor) -> torch.Tensor:
    """logits (R, V) split on the vocabulary -> the rows' mean entropy (0-dim, fp32; 0 without rows), the same
    on every rank."""
    z, _, group = _shard(logits)
    z = z.float()
    top = z.max(-1).values
    dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
    e = (z - top[:, None]).exp()
    sums = torch.stack([e.sum(-1), (e * z).sum(-1)])
    dist.all_reduce(sums, group=group)
    rows = top + sums[0].log() - sums[1] / sums[0]
    return rows.sum() / max(rows.numel(), 1)
