"""A block draft's decoding (base.py's ``Draft`` protocol): the context cache and one block per round.

The state (base.py's context invariant) keeps, per layer, K_ctx/V_ctx for every
context position that has target features (0..len-2) in a static (L,B,Hkv,M,D) cache, plus
the pending token (position len-1), which is the block anchor. ``commit`` projects only the
new features (a plain step's one token is kept in ``deferred`` and projected with the others in one
call before the next proposal); ``propose`` runs one block forward over [pending, MASK×(S−1)] at positions
len-1..len-2+S against the cache. There the block's own K/V are written into the cache at those
positions (free until ``commit`` writes the next context there; M leaves ``block_size`` of room past
the target's cache), so the two parts of the branch attention are one attention over each row's
prefix [0, len-1+S): a third of the ops of computing and merging two. No host syncs: reads are
bounded by the host-known ``context_len``, writes are scatters at per-row positions.

``BlockDecoding`` is a mixin of the block draft module (block_backbone.py), which gives it the
backbone (``layers``, ``context``, ``context_kv``, ``tapped``, ``block_input``, ``run_blocks``,
``norm``, ``fc``, ``hidden_norm``, ``inv_freq``, ``product``) and the fused C hooks
(``fused_block_decode``, ``fused_commit``). Not here: ``propose`` (dflash.py, dspark.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from codraft.attention import branch_main_part
from codraft.drafts.base import Features
from codraft.models.layers import rope_cos_sin


class BlockDraftState(NamedTuple):
    k: torch.Tensor  # (L,B,Hkv,M,D) context keys (k-normed, roped) at absolute positions
    v: torch.Tensor  # (L,B,Hkv,M,D) context values
    ctx_len: torch.Tensor  # (B,) long: positions 0..ctx_len-1 hold valid context K/V (= context length - 1)
    pending: torch.Tensor  # (B,) long: the last context token, at position ctx_len: the block anchor
    # tapped features (B,1,F) of the last positions before ctx_len whose K/V are not written yet: plain
    # steps' commits, written together before the next proposal (``written``, which empties this list in
    # place, as it writes the cache tensors in place)
    deferred: list


class BlockDecoding:
    """``begin``, ``commit``, ``select`` and the block's hidden over the cache; mixed into the block
    draft module (see the module doc)."""

    @torch.no_grad()
    def begin(self, tokens, lengths, features: Features, *, max_len: int) -> BlockDraftState:
        b, t = tokens.shape
        lc = self.config.layer_config()
        shape = (len(self.layers), b, lc.num_key_value_heads, max_len + self.config.block_size, lc.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=tokens.device)
        v = torch.zeros_like(k)
        ctx_len = lengths.to(torch.long) - 1
        n = min(features[self.feature_layers[0]].shape[1], max_len)
        ctx = self.context({l: features[l][:, :n] for l in self.feature_layers})  # (B,n,H); >= ctx_len: junk
        pos = torch.arange(n, device=tokens.device)[None].expand(b, n)
        for i, (kc, vc) in enumerate(self.context_kv(ctx, pos)):
            k[i, :, :, :n] = kc
            v[i, :, :, :n] = vc
        pending = tokens.gather(1, ctx_len[:, None])[:, 0]
        return BlockDraftState(k, v, ctx_len, pending, [])

    @torch.no_grad()
    def commit(self, state: BlockDraftState, tokens, counts, features: Features) -> BlockDraftState:
        g1 = tokens.shape[1]
        pending = tokens.gather(1, (counts - 1)[:, None])[:, 0]
        x = self.tapped({l: features[l][:, :g1] for l in self.feature_layers})  # (B,γ+1,m·H_t)
        if g1 == 1:  # a plain step's token (no proposal ran): its K/V wait for the next proposal
            return BlockDraftState(state.k, state.v, state.ctx_len + counts, pending, [*state.deferred, x])
        # features[:, j] belong at position ctx_len + j (the old pending token, then accepted drafts)
        self.write_context(self.written(state), x, state.ctx_len)
        return BlockDraftState(state.k, state.v, state.ctx_len + counts, pending, [])

    def written(self, state: BlockDraftState) -> BlockDraftState:
        """``state`` with its deferred context K/V written into its cache (all in place), in one call: a
        rollout whose draft length is 0 for many rounds (many rows, ``gamma=auto``) pays the draft's
        context once, when it drafts again, not a one-token commit every round."""
        if state.deferred:
            x = torch.cat(state.deferred, 1)  # (B,n,F): positions ctx_len − n .. ctx_len − 1
            self.write_context(state, x, state.ctx_len - x.shape[1])
            state.deferred.clear()
        return state

    def write_context(self, state: BlockDraftState, x: torch.Tensor, start: torch.Tensor) -> None:
        """Context K/V of tapped features x (B,n,F) at positions start + 0..n−1 into the cache, none past
        its end (positions past a row's accepted tokens hold junk, overwritten later)."""
        pos = start[:, None] + torch.arange(x.shape[1], device=x.device)  # (B,n)
        if self.fused_commit is not None:
            cos, sin = rope_cos_sin(self.inv_freq, pos, x.dtype)
            if self.fused_commit(self.fc.weight, self.hidden_norm, self.layers, x, cos, sin, state.k, state.v,
                                 start):
                return
        ctx = self.hidden_norm(self.product(x, self.fc.weight))  # (B,n,H)
        idx = pos.clamp(max=state.k.shape[3] - 1)  # only junk slots can exceed the buffer
        for i, (kc, vc) in enumerate(self.context_kv(ctx, pos)):
            gidx = idx[:, None, :, None].expand_as(kc)
            state.k[i].scatter_(2, gidx, kc)
            state.v[i].scatter_(2, gidx, vc)

    def select(self, state: BlockDraftState, rows) -> BlockDraftState:
        return BlockDraftState(state.k[:, rows], state.v[:, rows], state.ctx_len[rows], state.pending[rows],
                               [x[rows] for x in state.deferred])

    take = select  # (indexing copies: ``state`` is left as it was)

    def join(self, states: list[BlockDraftState]) -> BlockDraftState:
        states = [self.written(s) for s in states]  # (the deferred context K/V, into each state's own cache)
        return BlockDraftState(*(torch.cat([getattr(s, f) for s in states], 1 if f in "kv" else 0)
                                 for f in ("k", "v", "ctx_len", "pending")), [])

    def decode_hidden(self, state: BlockDraftState, slots: int, context_len: int) -> torch.Tensor:
        """Final-normed hidden (B,S,H) of the block [pending, MASK×(S−1)] over the cached context.

        The block's K/V are written past each row's context (``BlockDecoderLayer.decode``) when the
        buffer has room for them (``begin`` leaves ``block_size`` positions beyond ``max_len``); longer
        blocks at the end of the buffer take the training path's two-part attention instead."""
        state = self.written(state)
        keys = context_len - 1 + slots  # context_len - 1 >= every row's ctx_len
        if keys <= state.k.shape[3]:
            x = self.block_input(state.pending[:, None], slots)[:, 0]  # (B,S,H)
            positions = state.ctx_len[:, None] + torch.arange(slots, device=x.device)
            cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # (B,1,S,D)
            fused = self.fused_block_decode
            done = None if fused is None else fused(self.layers, x, cos, sin, state.k, state.v, state.ctx_len)
            if done is not None:
                return self.norm(done)
            for i, layer in enumerate(self.layers):
                x = layer.decode(x, cos, sin, state.k[i], state.v[i], state.ctx_len, keys)
            return self.norm(x)
        span = max(1, min(context_len - 1, state.k.shape[3]))  # context K/V live at positions < ctx_len
        kv = [(state.k[i, :, :, :span], state.v[i, :, :, :span]) for i in range(len(self.layers))]
        x = self.block_input(state.pending[:, None], slots)  # (B,1,S,H)
        anchors = state.ctx_len[:, None]  # (B,1): attend to context positions < ctx_len
        part = functools.partial(branch_main_part, anchors=anchors, include_anchor=False)
        return self.run_blocks(x, anchors, kv, part)[:, 0]


__all__ = ["BlockDecoding", "BlockDraftState"]
