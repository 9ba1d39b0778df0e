"""Batched generation with a static KV cache, plain or with lossless speculative decoding.

One ``generate`` call:
  1. prefill: the right-padded prompts in one forward into a pre-allocated ``KVCache``
     (per-row lengths); the first new token is sampled from each row's last prompt logit.
     A prompt repeated in the batch (a GRPO group) is prefilled once and its cache rows,
     last logit and tapped features are copied to every row that repeats it. A prefix that
     every distinct prompt shares (chat template, task instructions) runs once, in a forward of
     its own, and the cache rows start from a copy of it (``shared_prefix``);
  2. rounds, until every row has stopped; each round drafts g tokens (g = γ, or with
     gamma="auto" a g in 0..γ chosen from the live row count, ``draft_length``):
       plain:  feed the pending token (B,1), sample one token (g = 0 with a draft: the
               forward also taps the draft's layers and the draft commits that token);
       spec:   the draft proposes x_1..x_g (+ q rows); ONE target forward over
               [pending, x_1..x_g] (B,g+1) written at cache.lengths; ``verify_drafts`` accepts
               n per row and emits n+1 tokens; the cache rolls back per row to
               old + n + 1 (stale slots are masked); the draft commits the same tokens;
  3. per round one host sync (done flags, the longest cache row, the round's acceptance counts):
     rows that hit EOS or max_new_tokens are dropped from the cache, the draft and the batch.
Row invariant: the cache holds the row's context except its last (pending) token.
Outputs accumulate on the device and are copied to the host once at the end.
"""
from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass
from time import perf_counter

import torch
import torch.nn as nn

from codraft.kernels.sampling import sample as fast_sample, verify as fast_verify
from codraft.models import KVCache
from codraft.models.moe import Routing
from codraft.rollout.draft_length import AcceptanceEstimate, choose, load_or_calibrate
from codraft.rollout.stats import SpecStats
from codraft.spec.sampling import Sampler
from codraft.spec.verify import Verdict, verify_drafts


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, up to and including EOS
    logprobs: list[float]  # target logprob of each, see codraft.spec.sampling for the convention
    finish_reason: str  # "eos" or "length" (multi-turn episodes: also "context", "turns")
    mask: list[bool] | None = None  # multi-turn: True where the policy generated the token (None: everywhere)
    turns: int = 1  # the policy's turns (multi-turn episodes)
    # Engine(record_routes=True) on a MoE target: (prompt + tokens, MoE layers, k) the experts each token was
    # routed to when it was an input (int16; −1 where it never was: the last token), for routing replay
    routes: torch.Tensor | None = None


class Engine:
    """Rollout engine: ``Engine(model, draft=None, gamma=None, *, cost_model=None, max_len=None)``.

    draft: a ``codraft.drafts.Draft`` (None = plain decoding); gamma: tokens drafted per round
    (default ``draft.default_gamma``), or "auto": each round drafts 0..``draft.default_gamma``
    tokens, chosen by ``draft_length.choose`` from the live row count, a running acceptance
    estimate (``self.acceptance``, kept across calls) and ``cost_model`` (default: calibrated on
    this device at the first call, cached on disk); max_len: longest prompt + new tokens allowed
    (default ``model.config.max_position_embeddings``); timing_sync: sync the device at every phase
    boundary so ``stats`` splits time exactly on accelerators (costs extra syncs); record_routes: on a
    mixture-of-experts target, each result's ``routes`` (routing replay).
    ``self.gamma`` is the most tokens a round drafts.
    """

    def __init__(self, model: nn.Module, draft=None, gamma: int | str | None = None, *, cost_model=None,
                 max_len: int | None = None, timing_sync: bool = False, record_routes: bool = False):
        cfg = model.config
        if draft is None and gamma is not None:
            raise ValueError(f"gamma={gamma} given without a draft")
        auto = gamma == "auto"
        if cost_model is not None and not auto:
            raise ValueError(f'a cost_model is for gamma="auto", got gamma={gamma!r}')
        if draft is not None:
            gamma = draft.default_gamma if gamma is None or auto else gamma
            if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
                raise ValueError(f'gamma must be an int >= 1 or "auto", got {gamma!r}')
            if draft.vocab_size != cfg.vocab_size:
                raise ValueError(f"draft vocab_size={draft.vocab_size} != target vocab_size={cfg.vocab_size}")
            bad = [i for i in draft.feature_layers if not 0 <= i < cfg.num_hidden_layers]
            if bad:
                raise ValueError(f"draft.feature_layers {bad} out of range for a {cfg.num_hidden_layers}-layer target")
        self.max_len = cfg.max_position_embeddings if max_len is None else max_len
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        self.model, self.draft, self.gamma = model, draft, gamma or 0
        self.acceptance = AcceptanceEstimate(self.gamma) if auto else None
        self.cost_model, self._calibrates = cost_model, auto and cost_model is None
        self.timing_sync = timing_sync
        self.record_routes = record_routes and getattr(model.config, "moe", False)
        self.device = next(model.parameters()).device
        if isinstance(draft, nn.Module):
            draft.to(self.device)
        self.stats = SpecStats(gamma=self.gamma)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 eos_id: int | list[int] | None = None, progress=None) -> list[GenerationResult]:
        """One result per prompt. temperature 0 = greedy. eos_id defaults to model.config.eos_token_id;
        seed None draws one from torch's global RNG (so torch.manual_seed makes runs repeatable).
        progress: called after every round with the number of rows finished (host-side, no extra sync)."""
        run = self.start(prompts, max_new_tokens, temperature, top_p, top_k, seed, eos_id)
        while not run.finished:
            run.step()
            if progress is not None:
                progress(len(prompts) - (0 if run.finished else run.rows.numel()))
        results = run.results()
        self.stats = run.stats
        return results

    def start(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=None,
              eos_id=None, *, stop=(), kind=None) -> "Rollout":
        """Validate, prefill and return the ``Rollout`` (``generate`` steps it to the end); ``stop``: more
        token ids a row stops after, ``kind``: a ``Rollout`` subclass (multi-turn: ``turns.TurnRollout``)."""
        self._check(prompts, max_new_tokens)
        _check_sampling(temperature, top_p, top_k, seed)
        if self._calibrates and (self.cost_model is None or self.cost_model.rows[-1] < len(prompts)):
            self.cost_model = load_or_calibrate(self.model, self.draft, self.gamma, len(prompts))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(torch.randint(2**62, (1,))) if seed is None else seed)
        sampler = Sampler(temperature, top_p, top_k, gen)
        eos = token_ids(self.model.config.eos_token_id if eos_id is None else eos_id)
        return (kind or Rollout)(self, [list(p) for p in prompts], max_new_tokens, sampler, eos, list(stop))

    def _check(self, prompts, max_new_tokens):
        validate_prompts(prompts, max_new_tokens, self.max_len, self.model.config.vocab_size)


def validate_prompts(prompts, max_new_tokens, max_len: int, vocab_size: int) -> None:
    """A generate call's refusals, one line each (every engine's: codraft's and codraft.vllm's)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (at least one token is needed)")
        if len(p) + max_new_tokens > max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens + max_new_tokens={max_new_tokens} > max_len={max_len}")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")


def token_ids(ids: int | list[int] | None) -> list[int]:
    """An id, a list of them or None (a config's eos_token_id, an eos_id argument) as a list."""
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


SHARED_PREFILL_MIN = 32  # prompt tokens a shared prefix must save: its forward streams the weights once more


def shared_prefix(prompts: list[tuple[int, ...]]) -> int:
    """Tokens at the start of every one of the distinct ``prompts`` that the prefill computes once
    (chat template and task instructions: most of an RL prompt), 0 when that saves fewer than
    ``SHARED_PREFILL_MIN`` prompt tokens; every row keeps at least one token of its own, whose
    logits are its first sample's."""
    if len(prompts) < 2:
        return 0
    n = min(map(len, prompts)) - 1
    first = prompts[0]
    n = next((i for i in range(n) if any(p[i] != first[i] for p in prompts)), n)
    return n if n * (len(prompts) - 1) >= SHARED_PREFILL_MIN else 0


def _check_sampling(temperature, top_p, top_k, seed):
    """The sampling settings, refused before any work (the ``Sampler`` would accept a NaN temperature)."""
    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    if not real(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature!r}")
    if not real(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
        raise ValueError(f"seed must be an int or None, got {seed!r}")


class Rollout:
    """One batched generation in progress: prefilled on construction, advanced by ``step()``."""

    @torch.inference_mode()
    def __init__(self, engine: Engine, prompts: list[list[int]], max_new: int, sampler: Sampler, eos: list[int],
                 stop: list[int] = ()):
        self.model, self.draft, self.gamma = engine.model, engine.draft, engine.gamma
        self.acceptance, self.cost_model = engine.acceptance, engine.cost_model
        self.sampler, self.max_new, self.timing_sync = sampler, max_new, engine.timing_sync
        self.taps = tuple(self.draft.feature_layers) if self.draft is not None else ()
        dev = self.device = engine.device
        self.stats = SpecStats(gamma=self.gamma, accepted_per_position=[0] * self.gamma,
                               drafted_per_position=[0] * self.gamma,
                               gamma_chosen=[0] * (self.gamma + 1) if self.draft is not None else [])
        self._t0 = self._t = perf_counter()
        b, t = len(prompts), max(map(len, prompts))
        ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts], device=dev)  # (B,T) right-padded
        lens = torch.tensor([len(p) for p in prompts], device=dev)  # (B,)
        first = {}  # prompt -> its first row: repeated prompts are prefilled once
        src = torch.tensor([first.setdefault(tuple(p), i) for i, p in enumerate(prompts)], device=dev)  # (B,)
        uniq = torch.tensor(sorted(first.values()), device=dev)  # (U,) rows that are prefilled
        self.eos = torch.tensor(eos, dtype=torch.long, device=dev)
        self.stops = torch.tensor(list(eos) + list(stop), dtype=torch.long, device=dev)  # a row stops after these
        self.cache = KVCache.for_model(self.model, len(uniq), t + max_new + self.gamma + 1)
        self.rows = torch.arange(b, device=dev)  # original index of each active row
        self.out_tokens = torch.zeros(b, max_new + self.gamma + 1, dtype=torch.long, device=dev)
        self.out_logp = torch.zeros(b, max_new + self.gamma + 1, device=dev)
        self.n_out = torch.zeros(b, dtype=torch.long, device=dev)
        self.prompt_lens = [len(p) for p in prompts]
        self.routes = None  # (B, positions, MoE layers, k) with record_routes: codraft.models.moe.Routing
        if engine.record_routes:
            c = self.model.config
            moe_layers = sum(c.sparse_layer(i) for i in range(c.num_hidden_layers))
            self.routes = torch.full((b, t + max_new + self.gamma + 1, moe_layers, c.num_experts_per_tok), -1,
                                     dtype=torch.int16, device=dev)
            self._recorder = Routing(self.model)  # installed around each target forward, popped after it
        self._round_accepted = torch.zeros(0, dtype=torch.long, device=dev)  # (g,) rows that accepted >= k
        self.finished = False

        shared = shared_prefix(list(first))
        logits, feats = self._prefill(ids[uniq], lens[uniq], shared)  # (U,1,V)
        slot = torch.searchsorted(uniq, src)  # (B,) position of each row's source in uniq
        if len(uniq) < b:  # copy each prefilled row to the rows that repeat its prompt
            self.cache.select(slot)
            logits, feats = logits[slot], {l: f[slot] for l, f in feats.items()}
        if self.routes is not None:  # the prompts' routes, to every row; none past a prompt's end
            self.routes[:, :t] = self._prefill_routes[slot]
            self.routes[:, :t][torch.arange(t, device=dev)[None] >= lens[:, None]] = -1
        self.cache.set_lengths(lens, span=t)
        self.last, logp = self._sample(logits[:, 0])  # (B,) the pending token
        self._lap("prefill_s")
        if self.draft is not None:
            ctx = torch.cat([ids, ids[:, :1]], 1).scatter(1, lens[:, None], self.last[:, None])  # (B,T+1)
            self.draft_state = self.draft.begin(ctx, lens + 1, feats, max_len=self.cache.max_len)
            self._lap("draft_s")
        self._emit(self.last[:, None], logp[:, None], torch.ones_like(lens))
        self._sync()
        self._lap("bookkeeping_s")

    def _prefill(self, ids: torch.Tensor, lens: torch.Tensor, shared: int):
        """Prefill the distinct prompts ids (U,T) into the empty cache -> last-token logits (U,1,V) and
        features at every position; their first ``shared`` tokens (the same in every row) run once, in a
        forward of their own, and the cache rows start from a copy of them."""
        if shared == 0:
            with self._routing() as r:
                out = self.model(ids, cache=self.cache, logit_index=lens - 1, taps=self.taps)
            self._prefill_routes = r and self._by_token(r.pop(), ids.shape)
            return out
        head = KVCache.for_model(self.model, 1, shared)
        with self._routing() as r:
            _, pre = self.model(ids[:1, :shared], cache=head, taps=self.taps, head=False)
            self.cache.start_from(head, shared)
            logits, feats = self.model(ids[:, shared:], cache=self.cache, logit_index=lens - shared - 1,
                                       taps=self.taps)
        if r is not None:
            rest = self._by_token(r.pop(), (len(ids), ids.shape[1] - shared))
            self._prefill_routes = torch.cat([self._by_token(r.pop(), (1, shared)).expand(len(ids), -1, -1, -1),
                                              rest], 1)
        return logits, {i: torch.cat([pre[i].expand(len(ids), -1, -1), f], 1) for i, f in feats.items()}

    def _routing(self):
        """Around a target forward: the experts it routes to, recorded (record_routes), else nothing."""
        return self._recorder if self.routes is not None else contextlib.nullcontext()

    @staticmethod
    def _by_token(calls: torch.Tensor, shape) -> torch.Tensor:
        """A forward's routes (L, B·T, k) -> (B, T, L, k)."""
        return calls.view(calls.shape[0], *shape, calls.shape[-1]).permute(1, 2, 0, 3).to(torch.int16)

    def _keep_routes(self, r, rows: torch.Tensor, start: torch.Tensor | None, counts):
        """A forward's routes at positions start + j, j < counts (per row, or one int), of ``rows`` (what the
        cache kept)."""
        if r is None:
            return
        w = r.calls[-1].shape[1] // len(rows)
        got = self._by_token(r.pop(), (len(rows), w))
        j = torch.arange(w, device=self.device)
        keep = (j < counts[:, None]) if torch.is_tensor(counts) else (j < counts).expand(len(rows), -1)
        self.routes[rows[:, None].expand(-1, w)[keep], (start[:, None] + j)[keep]] = got[keep]

    @torch.inference_mode()
    def step(self):
        """One decode step (plain, or g = 0) or one draft-verify round of g drafts, then the host sync."""
        if self.finished:
            return
        b = self.rows.numel()
        g = self.draft_length(b)
        start = None if self.routes is None else self.cache.lengths.clone()  # (where recorded routes go)
        if self.draft is None or g == 0:
            with self._routing() as r:
                logits, feats = self.model(self.last[:, None], cache=self.cache, taps=self.taps)  # (B,1,V)
            self._keep_routes(r, self.rows, start, 1)
            self.last, logp = self._sample(logits[:, 0])
            self._lap("verify_s")
            ones = torch.ones_like(self.last)
            self._emit(self.last[:, None], logp[:, None], ones)
            if self.draft is not None:  # the draft's context grows by the same token
                self.draft_state = self.draft.commit(self.draft_state, self.last[:, None], ones, feats)
                self._lap("draft_s")
            self._round_accepted = self._round_accepted[:0]
            self._row_accepted = None  # (no draft tokens this round)
        else:
            x, q = self.draft.propose(self.draft_state, g, self.sampler, context_len=self.cache.span + 1)
            self._lap("draft_s")
            with self._routing() as r:
                logits, feats = self.model(torch.cat([self.last[:, None], x], 1), cache=self.cache,
                                           taps=self.taps)  # (B,g+1,V)
            fast = fast_verify(logits, x, q, self.sampler)  # the same rule in one C call, where it applies
            v = Verdict(*fast) if fast is not None else verify_drafts(logits, x, q, self.sampler)
            self._lap("verify_s")
            # the tokens kept: n accepted + 1, or fewer where a stop token (EOS) or max_new cuts them
            counts = self._emit(v.tokens, v.logprobs, v.n_accepted + 1)
            self._keep_routes(r, self.rows, start, counts)
            # the forward advanced every row by g+1; keep [pending, x_1..x_{counts-1}]
            self.cache.set_lengths(self.cache.lengths - (g + 1) + counts)
            self.last = v.tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
            self._round_accepted = (v.n_accepted[:, None] > torch.arange(g, device=self.device)).sum(0)
            self._row_accepted = v.n_accepted
            self._lap("bookkeeping_s")
            self.draft_state = self.draft.commit(self.draft_state, v.tokens, counts, feats)
            self._lap("draft_s")
        self._round_rows = self.rows  # (the rows of this round: _sync drops those that stopped)
        accepted = self._sync()
        self._count(b, g, accepted)
        self._lap("bookkeeping_s")

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,V) -> the tokens drawn and their logprobs: in one C call where it applies."""
        fast = fast_sample(logits, self.sampler)
        return fast if fast is not None else self.sampler.sample_logits(logits)

    def draft_length(self, rows: int) -> int:
        """g for the next round: fixed γ, or (gamma="auto") the rule over host-side numbers only."""
        if self.draft is None:
            return 0
        if self.acceptance is None:
            return self.gamma
        return choose(rows, self.acceptance.values(), self.cost_model)

    def _count(self, rows: int, g: int, accepted: list[int]):
        """The round in the stats and the acceptance estimate; accepted[k-1]: rows that accepted >= k."""
        s = self.stats
        s.rounds += 1
        s.row_rounds += rows
        if self.draft is None:
            return
        s.gamma_chosen[g] += 1
        s.drafted += rows * g
        for k, n in enumerate(accepted):
            s.drafted_per_position[k] += rows
            s.accepted_per_position[k] += n
        if self.acceptance is not None:
            self.acceptance.observe(rows, accepted)

    def _emit(self, tokens: torch.Tensor, logp: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor | None = None):
        """Append tokens[b, :counts[b]] (B,m) to the outputs of ``rows`` (default: the batch's), cut at a stop
        token (EOS) and max_new; set self.done -> the tokens kept per row."""
        rows = self.rows if rows is None else rows
        n_out = self.n_out[rows]  # (B,)
        j = torch.arange(tokens.shape[1], device=self.device)
        room = torch.minimum(counts, self.max_new - n_out)
        is_eos = (j < room[:, None]) & (tokens[..., None] == self.stops).any(-1)  # (B,m); isin may sync
        hit = is_eos.any(-1)
        n_new = torch.where(hit, is_eos.long().argmax(-1) + 1, room)  # through the first EOS
        pos = n_out[:, None] + j  # (B,m): slots past n_new are junk, overwritten by later writes
        self.out_tokens[rows[:, None], pos] = tokens
        self.out_logp[rows[:, None], pos] = logp
        self.n_out[rows] = n_out + n_new
        self.done = hit | (n_out + n_new >= self.max_new)
        return n_new

    def _sync(self) -> list[int]:
        """The round's one host sync: done flags, the longest cache row and the round's acceptance
        counts (returned); drop finished rows."""
        longest = torch.where(self.done, 0, self.cache.lengths).max()  # over the rows that continue
        flags = torch.cat([self.done.long(), longest[None], self._round_accepted]).tolist()
        b = self.done.numel()
        done, self.cache.span = flags[:b], flags[b]  # exact span: attention reads no further
        if any(done):
            self._leave([i for i, d in enumerate(done) if d], [i for i, d in enumerate(done) if not d])
        return flags[b + 1:]

    def _leave(self, done: list[int], keep: list[int]):
        """Rows ``done`` have stopped: drop them from the cache, the draft and the batch."""
        if not keep:
            self.finished = True
            return
        keep = torch.tensor(keep, device=self.device)
        self.rows, self.last = self.rows[keep], self.last[keep]
        self.cache.select(keep)
        if self.draft is not None:
            self.draft_state = self.draft.select(self.draft_state, keep)

    def _lap(self, phase: str):
        if self.timing_sync and self.device.type != "cpu":
            getattr(torch, self.device.type).synchronize()
        now = perf_counter()
        setattr(self.stats, phase, getattr(self.stats, phase) + now - self._t)
        self._t = now

    def results(self) -> list[GenerationResult]:
        """Copy the outputs to the host (once) and fill the final stats."""
        k = self.max_new
        tokens, logps, n = self.out_tokens[:, :k].tolist(), self.out_logp[:, :k].tolist(), self.n_out.tolist()
        eos = set(self.eos.tolist())
        self.stats.accepted = sum(self.stats.accepted_per_position)
        self.stats.emitted_tokens = sum(n)
        self._lap("bookkeeping_s")
        self.stats.total_s = self._t - self._t0
        out = [GenerationResult(t[:m], lp[:m], "eos" if m and t[m - 1] in eos else "length")
               for t, lp, m in zip(tokens, logps, n)]
        if self.routes is not None:  # over each row's prompt and tokens
            for res, r, p in zip(out, self.routes.cpu(), self.prompt_lens):
                res.routes = r[:p + len(res.tokens)]
        return out
