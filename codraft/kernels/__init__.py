"""The CPU decode fast path, installed on a module tree from outside: ``enable(module)``.

C kernels, built on first use by ``cbuild`` (system compiler, cached): few-row products
(``gemv``) and the rest of a KV-cache decode step (``decode_ops``: RMSNorm, RoPE + cache write
+ attention, a whole decoder layer in one call). ``enable`` changes the class of every
reference module it finds (``codraft.models``' Transformer, DecoderLayer, Attention, MLP,
RMSNorm, drafts' included) to its subclass in ``fast_layers``, which takes the C path when it
applies (CPU, fp32 activations, fp32 or bf16 weights, no autograd) and otherwise runs the
reference forward; and fills the hooks other modules declare (``HOOKS``): ``product`` (block drafts:
their product with the target's LM head, their layers' projections, DSpark's Markov bias) gets the
fast product, ``fused_block_decode`` and ``fused_commit`` (block drafts) their layers' decode and their
commit's context K/V in one C call each (``block_layers``), ``fused_markov`` (DSpark) its proposal loop
in one (``markov``). The rollout engine draws the target's tokens through ``sampling`` (a decode
step's draw, the verify rule) where that applies. Between
paths that all apply (the kernel or torch's products; one C call per layer or one per op) the
fastest for the shape and row count is chosen by timing them on this machine the first time
(``dispatch``, cached on disk). Parameter
names, state dicts, autograd, ``copy.deepcopy``, pickling and ``Module.to`` are unaffected.
``CODRAFT_KERNELS=0``, or no C compiler (warned once), leaves every module plain.

Not here: the reference model (``codraft.models``); GPU kernels.
"""
from __future__ import annotations

from typing import TypeVar

import torch.nn as nn

from codraft.kernels import block_layers, decode_ops, gemv, markov, products
from codraft.kernels.fast_layers import SWAPS

# hooks a module declares as class attributes (the reference code's own path, or None), set on it to
# the fast ones: x @ wᵀ; a block draft's layers over one block per row, and its commit, in one C call each;
# DSpark's Markov loop
HOOKS = {"product": products.linear, "fused_block_decode": block_layers.decode, "fused_commit": block_layers.commit,
         "fused_markov": markov.propose}

M = TypeVar("M")


def available() -> bool:
    """Whether the C kernels are built and not opted out (``CODRAFT_KERNELS=0``)."""
    return gemv.kernel() is not None and decode_ops.kernels() is not None


def enable(module: M) -> M:
    """Install the fast path on ``module`` and everything under it; returns ``module``.

    Swaps exact reference classes only (a subclass of one is left alone). Idempotent; a draft that
    is not an ``nn.Module`` (the n-gram draft) is returned as is."""
    if not isinstance(module, nn.Module) or not available():
        return module
    for m in module.modules():
        fast = SWAPS.get(type(m))
        if fast is not None:
            m.__class__ = fast
            continue
        for name, fast in HOOKS.items():  # in a module that is not a swapped reference one
            if hasattr(type(m), name):
                setattr(m, name, fast)
    return module


__all__ = ["available", "enable"]
