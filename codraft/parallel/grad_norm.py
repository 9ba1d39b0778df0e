"""Gradient clipping by the global norm, for parameters that are plain tensors, DTensor shards or a mix.

``torch.nn.utils.clip_grad_norm_`` runs one fused norm over all gradients, which refuses plain tensors next
to DTensors (tensor parallelism leaves the norms plain and splits the products) and DTensors of different
meshes (FSDP over dp: a plain-born parameter's mesh is dp's, a tensor-parallel one's is dp × tp). Here each
kind is normed on its own: a DTensor group's norm is reduced over its mesh (``full_tensor``), a plain
tensor counts once (every rank holding it holds all of it), and the squares add.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global norm is at most ``max_norm``; returns the norm
    before clipping (a plain 0-dim tensor, the same on every rank). Collective over the DTensors' meshes."""
    groups: dict = {}  # the DTensors' meshes (None: plain tensors) -> the parameters with gradients
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
