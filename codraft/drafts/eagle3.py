"""EAGLE-3 draft ("eagle3" kind): one decoder layer over fused target features, trained by TTT.

Data flow (H = target hidden size, V = target vocab, V_d = draft vocab, taps = ``layers``)::

    target layer outputs h_l (B,T,H), l in layers ──cat──► fc: (len·H → H) ──► g_t      (step 0 only)
    target embedding (frozen, shared, detached) ──► emb(x_{t+1+j})
    midlayer(emb, hidden) ──► pre-norm output (B,T,H) ──► norm ──► lm_head (H→V_d) ──► logits
                   └──────── is the next step's hidden (steps j > 0)

Alignment (notes 1.3): draft row t at TTT step j reads (hidden, emb(x_{t+1+j})) at RoPE position
pos_t + j and is trained toward the teacher distribution over x_{t+2+j}, i.e. the teacher
logits of row t+1+j (DraftBatch convention: row t's teacher logits are over token t + 1).

Training, ``loss(batch)``: the training-time-test unroll of ``ttt_steps`` steps. Step 0 is varlen
causal attention over the packed row; step j > 0 attends to the step-0 keys of its sequence up
to and including its row (the same causal main part) plus its own row's steps 1..j (the
"diagonal" branch, ``branch_local_part``), merged by LSE. The main part goes through the batch's
``MainAttention`` (``batch.context``), so under context parallelism the ring supplies it and
the unroll runs on the rank's own rows, reading tokens and teacher rows at their global
positions. Per-step soft
cross-entropy against softmax(teacher restricted to the draft vocabulary) on positions whose
predicted token is inside the same sequence, marked by ``loss_mask`` and whose teacher top-1
is in the draft vocabulary; step weights ``loss_decay``^j (0.8).

Decoding (``begin/propose/commit/select``, base.py): the draft's KV cache holds the step-0 K/V
of every context pair (h_t, x_{t+1}), t = 0..len-2, made from the *target's* features, plus the
pre-norm output at t = len-2, which predicts x_1. Proposal k > 1 is TTT step k-1 at anchor
len-2: hidden = previous proposal's output, token x_{k-1}, position len-2+k-1, and its K/V are
written at the next cache slots, which is exactly the diagonal branch of that anchor. ``commit``
re-runs the step-0 layer over the γ+1 new (target feature, token) pairs at the same slots,
overwriting the speculative writes; rejected slots stay stale past ``lengths``.

The token embedding (and optionally the head init) is the target's: ``bind_target`` stores the
tensors outside the module (no parameter, not saved, used detached), so no gradient reaches the
policy. Checkpoints use the public EAGLE-3 layout (``LlamaForCausalLMEagle3``; see ``save``).

Not here: tree drafting, the optional ``fc_norm`` variant, the context-parallel ring itself
(``codraft.parallel``), vocabulary re-mapping after build.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from codraft.atomic import atomic_dir
from codraft.attention import branch_local_part, cache_causal_mask, merge_lse, sdpa
from codraft.drafts.base import Draft, Features
from codraft.drafts.batch import DraftBatch
from codraft.drafts.eagle3_layer import Eagle3Layer, check_layers, default_layers, vocab_map
from codraft.models.config import ModelConfig
from codraft.models.kv_cache import KVCache
from codraft.models.layers import RMSNorm, rope_cos_sin, rope_inv_freq
from codraft.models.tensor_files import load_safetensors
from codraft.spec.sampling import Sampler

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
_OVERRIDABLE = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "rope_scaling", "max_position_embeddings")


class Eagle3State(NamedTuple):
    cache: KVCache       # 1 layer; lengths = context length - 1; cache.span = host bound of lengths
    hidden: torch.Tensor  # (B,H) pre-norm midlayer output at the last cached pair (predicts x_1)


class Eagle3Draft(nn.Module, Draft):
    architectures = (ARCHITECTURE,)

    def __init__(self, config: ModelConfig, *, layers: Sequence[int], d2t: torch.Tensor, t2d: torch.Tensor,
                 ttt_steps: int = 7, loss_decay: float = 0.8, default_gamma: int = 4):
        super().__init__()
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        if t2d.shape != (config.vocab_size,) or d2t.dim() != 1:
            raise ValueError(f"t2d must be ({config.vocab_size},) and d2t 1-D; "
                             f"got {tuple(t2d.shape)}, {tuple(d2t.shape)}")
        self.config = config
        self.layers = list(layers)
        self.feature_layers = tuple(self.layers)
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = d2t.shape[0]
        self.ttt_steps, self.loss_decay, self.default_gamma = ttt_steps, loss_decay, default_gamma
        h = config.hidden_size
        self.fc = nn.Linear(len(self.layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.long().clone())
        self.register_buffer("t2d", t2d.bool().clone())
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self._target = None  # (embed (V,H), head (V,H) | None), the target's tensors; not parameters

    # ---- target binding --------------------------------------------------------------------

    def bind_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor | None = None) -> "Eagle3Draft":
        """Share the target's token embedding (V,H) (and LM head (V,H), for ``init_from_target``).

        Stored by reference outside the module's parameters and state dict and always read
        ``.detach()``-ed: the draft follows the policy's in-place updates, never sends it gradient.
        """
        want = (self.vocab_size, self.config.hidden_size)
        for name, w in (("embed_weight", embed_weight), ("head_weight", head_weight)):
            if w is not None and tuple(w.shape) != want:
                raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {want} (target vocab, hidden)")
        self._target = (embed_weight, head_weight)
        return self

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._target is None:
            raise RuntimeError("EAGLE-3 draft has no token embedding: call bind_target(target.embed_tokens.weight, "
                               "target.head_weight) first")
        return F.embedding(ids, self._target[0].detach()).to(self.fc.weight.dtype)

    @torch.no_grad()
    def init_from_target(self) -> "Eagle3Draft":
        """Initialise lm_head from the bound target head's rows of the draft vocabulary."""
        if self._target is None or self._target[1] is None:
            raise RuntimeError("init_from_target needs bind_target(embed_weight, head_weight) with a head")
        head = self._target[1].detach()
        self.lm_head.weight.copy_(head[self.used_ids().to(head.device)].to(self.lm_head.weight))
        return self

    def used_ids(self) -> torch.Tensor:
        """(V_d,) target id of every draft-vocabulary entry."""
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def _features(self, features: Features, t: int) -> torch.Tensor:
        """{layer: (B,≥t,H)} -> (B,t,len·H) in the draft's dtype, layers in ``self.layers`` order."""
        missing = [l for l in self.layers if l not in features]
        if missing:
            raise KeyError(f"EAGLE-3 draft needs target layer outputs {self.layers}; missing {missing} "
                           f"(got {sorted(features)})")
        return torch.cat([features[l][:, :t] for l in self.layers], dim=-1).to(self.fc.weight.dtype)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm midlayer output (...,H) -> draft-vocab logits (...,V_d)."""
        return self.lm_head(self.norm(hidden))

    def full_logits(self, logits_d: torch.Tensor) -> torch.Tensor:
        """(...,V_d) draft logits -> (...,V) over the target vocabulary, -inf outside the draft vocabulary."""
        if self.draft_vocab_size == self.vocab_size:
            return logits_d  # full vocabulary: used_ids() is arange(V)
        out = logits_d.new_full((*logits_d.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy(-1, self.used_ids(), logits_d)

    # ---- training: TTT unroll ----------------------------------------------------------------

    def ttt_logits(self, batch: DraftBatch) -> list[torch.Tensor]:
        """Draft logits (1,T_l,V_d) of every TTT step j = 0..ttt_steps-1 at the local rows
        g = ``batch.context.rows`` (row g predicts x_{g+2+j}); T_l = T without context parallelism.

        Collective calls (under CP): ``context.causal`` once per step, in step order.
        """
        for l, f in batch.features.items():
            if f.requires_grad:
                raise ValueError(f"features[{l}] requires grad: EAGLE-3 trains on detached target features")
        main = batch.context
        ids, g = batch.input_ids[0], main.rows.to(batch.device)  # (T,) global ids, (T_l,) global rows
        t = ids.shape[0]
        pos = main.positions().to(batch.device)[None]  # (1,T_l) restarting per sequence
        hidden = self.fc(self._features(batch.features, g.shape[0]))  # (1,T_l,H) = g_t
        k_main = v_main = None
        ks, vs, logits = [], [], []
        for j in range(self.ttt_steps):
            # Step j.1: inputs: token x_{g+1+j} (0 past the end of the row and on padding rows),
            # RoPE position pos_g + j
            src = g + 1 + j
            tok = torch.where((g >= 0) & (src < t), ids[src.clamp(0, t - 1)], torch.zeros_like(src))
            emb = self._embed(tok[None])  # (1,T_l,H)
            cos, sin = rope_cos_sin(self.inv_freq, pos + j, emb.dtype)
            q, k, v = self.midlayer.qkv(emb, hidden, cos, sin)  # (1,Hq,T_l,D), (1,Hkv,T_l,D) x2
            # Step j.2: attention. Step 0: causal over the main row (keys ≤ g of the same sequence).
            # Step j > 0: those step-0 keys (the same causal part, queried by step j) plus row g's
            # own steps 1..j (the diagonal branch), merged by LSE.
            if j == 0:
                k_main, v_main = k, v
                o, _ = main.causal(q, k_main, v_main)  # (1,Hq,T_l,D)
            else:
                ks.append(k)
                vs.append(v)
                om, lm = main.causal(q, k_main, v_main)
                ob, lb = branch_local_part(q[:, :, :, None], torch.stack(ks, dim=3), torch.stack(vs, dim=3),
                                           local="diagonal")  # branch k/v (1,Hkv,T_l,j,D)
                o = merge_lse(om[:, :, :, None], lm[..., None], ob, lb)[0][:, :, :, 0]
            # Step j.3: the rest of the layer; the pre-norm output is the next step's hidden
            hidden = self.midlayer.finish(o.to(q.dtype), hidden)  # (1,T_l,H)
            logits.append(self.head_logits(hidden))  # (1,T_l,V_d)
        return logits

    def loss(self, batch: DraftBatch, *, reduction: str = "mean", normaliser: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """TTT loss Σ_j decay^j · L_j and detached metrics.

        L_j = soft cross-entropy -Σ_v p·log q over positions where the predicted token x_{t+2+j}
        lies in t's sequence, is marked by ``loss_mask``, and the teacher's top-1 there is in the
        draft vocabulary; p = softmax(teacher over the draft vocabulary). reduction "mean"
        divides each step by its position count, "sum" does not (for global normalisation
        across micro-batches: metrics carry the counts). Metrics: ``loss``,
        ``step{j}/loss``, ``step{j}/acc`` (top-1 of the draft, mapped through d2t, equals the
        teacher's over valid loss_mask positions) and ``step{j}/positions``. No host sync
        without context parallelism. normaliser: the step's ``loss_normaliser`` (``Draft.loss``): each
        step's positions, then its accuracy's; None: this batch's.

        Context parallelism (``batch.main``): every rank returns the same (global) loss and
        metrics; the gradient flows through this rank's rows only. Collective calls, the same
        on every rank: ``causal`` × ttt_steps (``ttt_logits``), then one ``total`` of a
        (2·ttt_steps,) vector.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f'reduction must be "mean" or "sum", got {reduction!r}')
        if batch.teacher_logits.shape[-1] != self.vocab_size:
            raise ValueError(f"teacher_logits have vocab {batch.teacher_logits.shape[-1]}, draft target vocab "
                             f"is {self.vocab_size}")
        step_logits = self.ttt_logits(batch)
        main, dev = batch.context, batch.device
        # The masks and counts below are global (every rank computes them alike); the draft row t is
        # local to one rank only, so the numerators are summed over ranks (``main.total``) before dividing.
        rows = batch.teacher_rows.to(dev)  # (R,)
        teacher = batch.teacher_logits.detach()  # (R,V)
        top = teacher.argmax(-1)  # (R,) teacher top-1 over the full vocab
        in_vocab = self.t2d[top]  # (R,)
        sub = teacher if self.draft_vocab_size == self.vocab_size else teacher.index_select(-1, self.used_ids())
        dt = torch.promote_types(step_logits[0].dtype, torch.float32)  # loss dtype: >= fp32
        p = sub.to(dt).softmax(-1)  # (R,V_d) teacher renormalised over the draft vocab
        used = self.used_ids()
        ce_sums, hit_sums, n_pos, n_acc = [], [], [], []
        for j, (logits, acc_mask) in enumerate(zip(step_logits, self._step_masks(batch))):
            row = rows - 1 - j  # (R,) the draft row trained toward teacher row r (global)
            pos_mask = acc_mask & in_vocab
            n_pos.append(pos_mask.sum())
            n_acc.append(acc_mask.sum())
            loc = main.local_index(row.clamp_min(0))  # (R,) local row, -1 where another rank holds it
            here = loc >= 0
            p_j, top_j, pos_j, acc_j = p, top, pos_mask & here, acc_mask & here
            if main.num_ranks > 1:  # most teacher rows are another rank's: keep this rank's (a host sync)
                pick = here.nonzero()[:, 0]
                loc, p_j, top_j, pos_j, acc_j = (x[pick] for x in (loc, p_j, top_j, pos_j, acc_j))
            lg = logits[0, loc.clamp_min(0)]  # (R_l,V_d)
            ce = -(p_j * lg.to(dt).log_softmax(-1)).sum(-1)  # (R_l,)
            ce_sums.append((ce * pos_j).sum())
            hit_sums.append(((used[lg.argmax(-1)] == top_j) & acc_j).sum().to(dt))
        # one cross-rank sum for every numerator (hits carry no gradient)
        steps = len(step_logits)
        sums = main.total(torch.stack(ce_sums + [h.detach() for h in hit_sums]))
        positions = n_pos
        if normaliser is not None:
            n_pos, n_acc = normaliser.to(dev).split(steps)
        total = torch.zeros((), dtype=dt, device=dev)
        metrics: dict[str, torch.Tensor] = {}
        for j in range(steps):
            l_j = sums[j]
            if reduction == "mean":
                l_j = l_j / n_pos[j].clamp_min(1)
            total = total + self.loss_decay ** j * l_j
            metrics[f"step{j}/loss"] = l_j.detach()
            metrics[f"step{j}/acc"] = sums[steps + j].detach() / n_acc[j].clamp_min(1)
            metrics[f"step{j}/positions"] = positions[j]
        metrics["loss"] = total.detach()
        return total, metrics

    def _step_masks(self, batch: DraftBatch) -> list[torch.Tensor]:
        """Per TTT step j, (R,) bool over ``batch.teacher_rows``: step j trains the draft at row
        t = r − 1 − j toward teacher row r, which predicts x_{r+1}; valid when x_{r+1} is a loss token of
        t's sequence (only those teacher rows are read). Global: the same on every rank."""
        cu, t, dev = batch.cu_seqlens.to(batch.device), batch.input_ids.shape[1], batch.device
        n_seq = cu.numel() - 1
        end = cu[1:][torch.searchsorted(cu[1:], torch.arange(t, device=dev), right=True).clamp(max=n_seq - 1)]
        # (T,) end of t's sequence (cu[-1] for padding: never valid)
        rows = batch.teacher_rows.to(dev)  # (R,)
        supervised = (rows + 1 < t) & batch.loss_mask[0, (rows + 1).clamp(max=t - 1)].bool()  # (R,)
        # (and no observation among x_{r-j}..x_{r+1}: the chain the draft would propose from t, multi-turn)
        return [supervised & (rows - 1 - j >= 0) & (rows + 1 < end[(rows - 1 - j).clamp_min(0)])
                & batch.unbroken(rows - j, rows + 1) for j in range(self.ttt_steps)]

    def loss_normaliser(self, batch: DraftBatch) -> torch.Tensor | None:
        """(2·ttt_steps,) int64: each step's positions (its loss's denominator), then the positions its
        accuracy counts. The loss keeps only positions whose teacher top-1 is in the draft vocabulary:
        known before the policy's forward with the full vocabulary only (else None)."""
        if self.draft_vocab_size != self.vocab_size:
            return None
        n = torch.stack([m.sum() for m in self._step_masks(batch)])
        return torch.cat([n, n])

    # ---- decoding --------------------------------------------------------------------------

    def _layer_step(self, emb, hidden, positions, cache: KVCache, span: int, mask) -> torch.Tensor:
        """One midlayer pass over new pairs (B,t,H) at ``positions`` (B,t), written into the cache."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, emb.dtype)
        q, k, v = self.midlayer.qkv(emb, hidden, cos, sin)  # (B,Hq,t,D), (B,Hkv,t,D)
        kc, vc = cache.write(0, k, v, positions.clamp(max=cache.max_len - 1), span)  # (B,Hkv,span,D)
        return self.midlayer.finish(sdpa(q, kc, vc, mask), hidden)  # (B,t,H)

    @torch.no_grad()
    def begin(self, tokens, lengths, features: Features, *, max_len: int) -> Eagle3State:
        b, t = tokens.shape
        if t < 2 or t - 1 > max_len:
            raise ValueError(f"begin needs 2 <= tokens.shape[1] <= max_len + 1, got {t} (max_len={max_len})")
        c, w = self.config, self.fc.weight
        cache = KVCache(num_layers=1, batch=b, max_len=max_len, num_kv_heads=c.num_key_value_heads,
                        head_dim=c.head_dim, dtype=w.dtype, device=w.device)
        # step-0 pairs (h_t, x_{t+1}) for t = 0..T-2 at slots t; rows are right-padded, so plain causal
        hidden = self.fc(self._features(features, t - 1))  # (B,T-1,H)
        positions = torch.arange(t - 1, device=tokens.device)[None].expand(b, -1)
        out = self._layer_step(self._embed(tokens[:, 1:]), hidden, positions, cache, t - 1, None)  # (B,T-1,H)
        last = out.gather(1, (lengths - 2)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # (B,H)
        cache.set_lengths(lengths - 1, span=t - 1)
        return Eagle3State(cache, last)

    @torch.no_grad()
    def propose(self, state: Eagle3State, gamma: int, sampler: Sampler, *, context_len: int):
        cache, h = state.cache, state.hidden
        cache.span = max(1, min(cache.span, context_len - 1))  # host bound of lengths, no sync
        tok, tokens, qs = None, [], []
        for k in range(gamma):
            if k > 0:
                # TTT step k at anchor len-2: hidden = previous output, token x_k, slot/position len-1+k-1
                pos = cache.lengths[:, None] + (k - 1)  # (B,1)
                span = min(cache.span + k, cache.max_len)
                h = self._layer_step(self._embed(tok[:, None]), h[:, None], pos, cache, span,
                                     cache_causal_mask(pos[:, 0], 1, span))[:, 0]  # (B,H)
            logits = self.full_logits(self.head_logits(h))  # (B,V), -inf outside the draft vocab
            if sampler.greedy:
                tok = logits.argmax(-1)
            else:
                q = sampler.probs(logits)  # (B,V) the row x_{k+1} is drawn from, 0 outside the draft vocab
                tok = sampler.sample(q)
                qs.append(q)
            tokens.append(tok)
        # lengths unchanged: the speculative K/V at slots len-1.. are overwritten by commit
        return torch.stack(tokens, 1), (torch.stack(qs, 1) if qs else None)

    @torch.no_grad()
    def commit(self, state: Eagle3State, tokens, counts, features: Features) -> Eagle3State:
        cache = state.cache
        g1 = tokens.shape[1]
        start = cache.lengths.clone()  # (B,) = old context length - 1
        pos = start[:, None] + torch.arange(g1, device=start.device)  # (B,γ+1) slots of the new pairs
        span = min(cache.span + g1, cache.max_len)
        # step-0 pairs (target feature before each appended token, that token)
        hidden = self.fc(self._features(features, g1))  # (B,γ+1,H)
        out = self._layer_step(self._embed(tokens), hidden, pos, cache, span,
                               cache_causal_mask(start, g1, span))  # (B,γ+1,H)
        last = out.gather(1, (counts - 1)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # (B,H)
        cache.set_lengths(start + counts, span=span)
        return Eagle3State(cache, last)

    def select(self, state: Eagle3State, rows) -> Eagle3State:
        state.cache.select(rows)
        return Eagle3State(state.cache, state.hidden[rows])

    def take(self, state: Eagle3State, rows) -> Eagle3State:
        return Eagle3State(state.cache.take(rows), state.hidden[rows])

    def join(self, states: list[Eagle3State]) -> Eagle3State:
        return Eagle3State(KVCache.cat([s.cache for s in states]), torch.cat([s.hidden for s in states]))

    # ---- checkpoint ------------------------------------------------------------------------

    def hf_config(self) -> dict:
        c = self.config
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": False, "target_hidden_size": c.hidden_size,
            "torch_dtype": str(self.fc.weight.dtype).removeprefix("torch."),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.layers)},
            "codraft": {"ttt_steps": self.ttt_steps, "loss_decay": self.loss_decay,
                        "default_gamma": self.default_gamma},
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (public EAGLE-3 names, no embed_tokens), atomically."""
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_dir(path) as tmp:
            (tmp / "config.json").write_text(json.dumps(self.hf_config(), indent=2) + "\n")
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, target_config: ModelConfig | None = None, *, gamma: int | None = None,
             dtype: torch.dtype | None = None, layers: Sequence[int] | None = None) -> "Eagle3Draft":
        """``load`` below, checked against ``target_config`` (taps, hidden size, vocabulary)."""
        draft = load(path, dtype=dtype, layers=layers)
        t = target_config
        if t is not None:
            if (draft.config.hidden_size, draft.vocab_size) != (t.hidden_size, t.vocab_size):
                raise ValueError(f"EAGLE-3 draft {path} has hidden_size={draft.config.hidden_size}, vocab_size="
                                 f"{draft.vocab_size}; target has {t.hidden_size}, {t.vocab_size}")
            if max(draft.layers) >= t.num_hidden_layers:
                raise ValueError(f"EAGLE-3 draft {path} taps layers {list(draft.layers)}, "
                                 f"target has {t.num_hidden_layers} layers")
        if gamma is not None:
            draft.default_gamma = gamma
        return draft


def load(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
         layers: Sequence[int] | None = None) -> Eagle3Draft:
    """Read a public-layout EAGLE-3 folder. dtype None: the config's ``torch_dtype`` (else float32).

    ``layers`` is needed only when config.json has no ``eagle_config.eagle_aux_hidden_state_layer_ids``.
    ``embed_tokens.weight``, if present, is ignored (the target's embedding is bound instead). A
    full-vocabulary folder may lack ``d2t`` / ``t2d`` (vLLM refuses them there): the identity map.
    """
    path = Path(path)
    cfg_file, weights = path / "config.json", path / WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not an EAGLE-3 folder: needs config.json and {WEIGHTS}")
    d = json.loads(cfg_file.read_text())
    if ARCHITECTURE not in (d.get("architectures") or []):
        raise ValueError(f"{cfg_file}: architectures={d.get('architectures')}, expected [{ARCHITECTURE!r}]")
    if d.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{cfg_file}: num_hidden_layers={d['num_hidden_layers']}; only 1-layer EAGLE-3 drafts exist")
    if d.get("target_hidden_size", d["hidden_size"]) != d["hidden_size"]:
        raise ValueError(f"{cfg_file}: target_hidden_size={d['target_hidden_size']} != hidden_size="
                         f"{d['hidden_size']}; the draft shares the target's embedding, so they must match")
    ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", layers)
    if ids is None:
        raise ValueError(f"{cfg_file} has no eagle_config.eagle_aux_hidden_state_layer_ids: pass layers=[...]")
    config = ModelConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                    "tie_word_embeddings": False})
    extra = d.get("codraft") or {}
    v, vd = d["vocab_size"], d.get("draft_vocab_size") or d["vocab_size"]
    with torch.device("meta"):  # shapes only; weights come from the file
        draft = Eagle3Draft(config, layers=[int(i) for i in ids], d2t=torch.zeros(vd, dtype=torch.long),
                            t2d=torch.zeros(v, dtype=torch.bool), ttt_steps=extra.get("ttt_steps", 7),
                            loss_decay=extra.get("loss_decay", 0.8), default_gamma=extra.get("default_gamma", 4))
    expected = draft.state_dict()
    tensors = load_safetensors(weights)
    tensors.pop("embed_tokens.weight", None)
    if vd == v and "d2t" not in tensors and "t2d" not in tensors:
        tensors.update(d2t=torch.zeros(v, dtype=torch.long), t2d=torch.ones(v, dtype=torch.bool))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights}: missing tensors {missing}, unexpected tensors {unexpected}")
    dtype = dtype or getattr(torch, d.get("torch_dtype") or "float32")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{weights}: tensor {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(expected[name].shape)} from config.json")
        tensors[name] = t.long() if name == "d2t" else t.bool() if name == "t2d" else t.to(dtype)
    used = tensors["d2t"] + torch.arange(vd)
    if (used[1:] <= used[:-1]).any() or used.min() < 0 or used.max() >= v or int(tensors["t2d"].sum()) != vd \
            or not tensors["t2d"][used].all():
        raise ValueError(f"{weights}: d2t/t2d do not describe an ascending draft vocabulary of {vd} of {v} tokens")
    draft.load_state_dict(tensors, assign=True)
    draft.inv_freq = rope_inv_freq(config)  # non-persistent buffer: rebuild off the meta device
    return draft.eval()


def build(target_config: ModelConfig, *, layers: Sequence[int] | None = None, ttt_steps: int = 7,
          draft_vocab_size: int | None = None, token_counts: torch.Tensor | Sequence[int] | None = None,
          loss_decay: float = 0.8, gamma: int | None = None, **overrides) -> Eagle3Draft:
    """A randomly initialised EAGLE-3 draft for ``target_config`` (seed with torch.manual_seed).

    layers: target layer outputs to tap (0-based); None = ``default_layers(L)``: [1, L//2-1, L-4]
    clamped to [0, L-1] and deduplicated for tiny targets. draft_vocab_size: None = the target's
    full vocabulary; smaller needs ``token_counts`` (V,) (``vocab_map``). overrides: any of
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
    rope_theta, rope_scaling, max_position_embeddings (default: the target's). hidden_size and
    vocab_size are the target's (shared embedding). gamma: tokens drafted per round by default (4).
    Call ``bind_target`` before use.
    """
    t = target_config
    for name in ("hidden_size", "vocab_size"):
        if name in overrides and overrides.pop(name) != getattr(t, name):
            raise ValueError(f"EAGLE-3 shares the target's embedding: {name} must be the target's {getattr(t, name)}")
    bad = sorted(set(overrides) - set(_OVERRIDABLE))
    if bad:
        raise ValueError(f"unknown EAGLE-3 options {bad}; overridable: {', '.join(_OVERRIDABLE)}")
    fields = {k: getattr(t, k) for k in _OVERRIDABLE}
    if "num_attention_heads" in overrides:  # re-derive what depends on the head count unless given
        fields["num_key_value_heads"] = fields["head_dim"] = None
    fields.update(overrides)
    config = ModelConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_hidden_layers=1,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], **fields)
    layers = default_layers(t.num_hidden_layers) if layers is None else check_layers(layers, t.num_hidden_layers)
    d2t, t2d = vocab_map(t.vocab_size, draft_vocab_size, token_counts)
    return Eagle3Draft(config, layers=layers, d2t=d2t, t2d=t2d, ttt_steps=ttt_steps, loss_decay=loss_decay,
                       default_gamma=gamma or 4)
