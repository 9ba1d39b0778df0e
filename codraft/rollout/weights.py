"""The weights the rollout engine decodes with: the trainer's, or a copy in a narrower dtype.

RL systems decode from low-precision weights while the trainer keeps fp32 masters (vLLM/SGLang
rollouts in verl and NeMo-RL). Decoding is memory-bound, so ``rollout.dtype=bfloat16`` halves
the bytes streamed per token. On CPU the copy is *weight-only*: every matrix (projections,
embedding, LM head) is cast; norms, activations, RoPE tables and the KV cache stay in the
trainer's dtype, so a product widens the weight exactly and accumulates in fp32 (the CPU kernels
stream bf16 directly; torch's fallback, ``codraft.models.layers.linear``, widens per call); the
matrices live in one buffer of 2 MB pages (``codraft.kernels.hugepages``: bf16 decode steps ~10 %
faster on a 2-core EPYC). Without a copy the engine streams the trainer's own matrices, and those move
into 2 MB pages in place (the same parameters, a new storage: fp32 steps ~10 % faster there). On
other devices every tensor is cast and the copy runs in bf16 throughout (tensor cores; widening
per call would stream more bytes, not fewer). Speculative decoding is lossless with respect to this
copy: it is the model that samples, and its logprobs are the rollout logprobs the GRPO loss
compares with the trainer's (mismatch metrics, optional truncated IS: ``grpo.tis_cap``).

A stale copy is the failure behind a "weights lost on refit" report (τ fell to 1): so
``refresh`` after every optimiser step is followed by ``check`` before every rollout, which
compares every tensor with the cast of the trainer's current one and raises
``StaleRolloutWeights`` naming the first that differs.

A draft's copy (``draft_for``; always a copy under ``gather``) is bound to the copy's embedding and LM head where they are
weight-only (a block draft's head product over its vocabulary is a large part of its cost). Its own
weights: the matrices the draft names (``Draft.rollout_narrowed``: a block draft's taps' fc and
layers, ~0.7 ms of a DSpark round at batch 1) are cast, refreshed and checked with the policy's; a
draft that names none (EAGLE-3) is shared as it is, trained in place, so it cannot go stale.

Under data parallelism (``gather=True``) the trainer's policy is sharded (FSDP2: its parameters become
DTensors), so there is always a full copy, in the rollout dtype, and ``refresh`` gathers every tensor
(``full_tensor``, collective: every rank refreshes and checks) — the "refit" of RL systems. The trainer's
own draft then reads the target's embedding and head from ``target_parts`` (full fp32, refreshed too).
Not here: the engine (``codraft.rollout.engine``).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from codraft import kernels
from codraft.errors import CodraftError
from codraft.kernels import hugepages
from codraft.models.layers import whole


class StaleRolloutWeights(CodraftError, RuntimeError):
    pass


def cast_for_rollout(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the rollout copy holds for trainer tensor ``t``: on CPU matrices in ``dtype`` and the rest
    as is (weight-only), elsewhere every floating tensor in ``dtype``."""
    cast = t.is_floating_point() and (t.dim() >= 2 or t.device.type != "cpu")
    return t.detach().to(dtype) if cast else t.detach()


class RolloutWeights:
    """``RolloutWeights(policy, dtype)``: ``.policy`` is what the engine decodes with — ``policy``
    itself when ``dtype`` is its own (nothing to refresh; its CPU matrices rehomed into 2 MB pages), else
    a copy in ``dtype`` (``cast_for_rollout``; kernels installed like the trainer's)."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype, *, gather: bool = False):
        self.source, self.dtype = policy, dtype
        self.copies, self.gather = gather or dtype != policy.embed_tokens.weight.dtype, gather
        self.parts = None  # gather, narrower copy: the fp32 embedding and head the trainer's draft reads
        self.policy = policy
        self.drafts: dict[int, tuple] = {}  # id(draft) -> (draft, its rollout copy): see draft_for
        # sharded pipeline stages: what fills the copies (each stage's shards, gathered and broadcast) and
        # says which tensors this rank's trainer holds (codraft.parallel.sharded_stages.StageRefit)
        self.refit = None
        if self.copies:
            if policy.embed_tokens.weight.dtype != torch.float32:
                raise ValueError(f"a {dtype} rollout copy is made from fp32 trainer weights, "
                                 f"got {policy.embed_tokens.weight.dtype} (policy.dtype)")
            self.policy = copy.deepcopy(policy).requires_grad_(False).eval()
            for p in self.policy.parameters():  # (the RoPE frequencies, a buffer, stay fp32)
                p.data = cast_for_rollout(p, dtype)
            kernels.enable(self.policy)
            if gather and dtype != torch.float32:
                self.parts = [policy.embed_tokens.weight.detach().clone(), policy.head_weight.detach().clone()]
        # streamed every decode step: in 2 MB pages (without a copy, the trainer's own, in place)
        matrices = [p for p in self.policy.parameters() if p.dim() >= 2 and p.device.type == "cpu"]
        self.huge_pages = hugepages.rehome(matrices)

    def draft_for(self, draft):
        """The draft the engine runs with this policy: ``draft`` itself, or (weight-only copy) a copy bound
        to the copy's embedding and head, holding ``draft.rollout_narrowed``'s matrices cast (made once per
        draft, refreshed and checked with the policy), else sharing every draft parameter."""
        if not isinstance(draft, nn.Module) or not self.copies or \
                (self.policy.compute_dtype != torch.float32 and not self.gather):
            return draft
        if not getattr(draft, "rollout_narrowed", ()) and not self.gather:  # (gather: the trainer's is sharded)
            return copy.copy(draft).bind_target(self.policy.embed_tokens.weight, self.policy.head_weight)
        held = self.drafts.get(id(draft))
        if held is None or held[0] is not draft:
            rolling = copy.deepcopy(draft).requires_grad_(False).eval()  # (the target's tensors: shared)
            for name, p in rolling.named_parameters():
                p.grad = None
                p.data = self._cast(draft, name, p)
            held = self.drafts[id(draft)] = (draft, rolling.bind_target(self.policy.embed_tokens.weight,
                                                                        self.policy.head_weight))
        return held[1]

    def target_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and LM head in full fp32, current after every ``refresh`` (gather=True)."""
        if self.parts is not None:
            return self.parts[0], self.parts[1]
        return self.policy.embed_tokens.weight, self.policy.head_weight

    def _cast(self, draft, name: str, t: torch.Tensor) -> torch.Tensor:
        """What a rollout copy holds for tensor ``name`` of ``draft`` (None: the policy)."""
        if draft is None or name.startswith(getattr(draft, "rollout_narrowed", ())) or \
                (self.gather and self.policy.compute_dtype != torch.float32):  # a copy cast throughout
            return cast_for_rollout(t, self.dtype)
        return t.detach()

    def _pairs(self):
        """(draft or None, name, trainer tensor, rollout tensor) over the policy and every draft copy (under
        sharded stages: those this rank's trainer holds)."""
        for src, dst, draft in [(self.source, self.policy, None), *((d, c, d) for d, c in self.drafts.values())]:
            for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
                if self.refit is None or self.refit.held(draft, name):
                    yield draft, name, whole(a), b

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the trainer's current weights (cast) into the rollout copies: after every optimiser step."""
        if self.refit is not None:
            self.refit(self)
        elif self.copies:
            for _, _, src, dst in self._pairs():
                dst.copy_(src)
            if self.parts is not None:
                for part, src in zip(self.parts, (self.source.embed_tokens.weight, self.source.head_weight)):
                    part.copy_(whole(src))

    @torch.no_grad()
    def check(self, when: str) -> None:
        """Raise ``StaleRolloutWeights`` unless every rollout tensor equals the cast of the trainer's."""
        if not self.copies:
            return
        for draft, name, src, dst in self._pairs():
            want = self._cast(draft, name, src)
            if dst.dtype != want.dtype or not torch.equal(dst, want):
                whose = "" if draft is None else f"{type(draft).__name__} draft's "
                raise StaleRolloutWeights(
                    f"{when}: the rollout engine's {self.dtype} copy of the {whose}{name!r} differs from the "
                    f"trainer's weights cast to {self.dtype}: the copy was not refreshed after the optimiser step")
