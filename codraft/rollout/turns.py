"""Multi-turn episodes on the rollout engine (``run_episodes``).

A row that ends its turn (a stop token: a tool call's closing tag, or EOS) leaves the decode batch with
its cache rows, draft state and pending token set aside (``TurnRollout``) while its environment answers.
The answer's tokens come back as a prefill onto that row's own cache, the history never prefilled
again, in one forward for the rows answered together; the target samples the row's next token from
the last of them, and the draft takes them in as a verify round's accepted tokens (``Draft.extend``,
with the target's features), so speculation resumes with its state up to date. Every policy token is
still sampled by the target, or accepted by the exact rule, from the same context a plain decode
sees: lossless across turns. Observation tokens are outputs with ``mask`` False (context, never a
training target) and logprob 0.

Environments answer outside the decode loop (``Answers``: ``submit`` a row's turn, ``ready`` hands the
answers in). ``overlap=True``: a row rejoins as soon as its answer is in while the others decode, so
the samples depend on the environments' timing; ``overlap=False``: every round first waits for the
answers of the rows that stopped, so a seeded run repeats exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Protocol

import torch

from codraft.models import KVCache
from codraft.rollout.engine import Engine, GenerationResult, Rollout


class Answers(Protocol):
    """The environments' side of ``run_episodes``."""
    pending: int  # turns submitted and not yet answered

    def submit(self, row: int, turn: list[int]) -> None:
        """Row ``row`` ended a turn with these tokens (its own, since the last observation)."""

    def ready(self, wait: str) -> list[tuple[int, list[int] | None]]:
        """The answers in: (row, observation tokens, or None when the episode ends). ``wait``: "none",
        "any" (at least one, when any is pending) or "all" (every pending one)."""


@dataclass
class _Parked:
    cache: KVCache
    draft: object
    last: torch.Tensor  # (1,) the pending token


class TurnRollout(Rollout):
    """A ``Rollout`` whose stopped rows are set aside (``parked``) rather than dropped, and come back with
    an observation (``rejoin``)."""

    def __init__(self, engine, prompts, max_new, sampler, eos, stop):
        self.parked: dict[int, _Parked] = {}
        self.left: list[int] = []  # rows that stopped since the driver last looked
        super().__init__(engine, prompts, max_new, sampler, eos, stop)
        self.policy_token = torch.ones_like(self.out_tokens, dtype=torch.bool)
        self.turn = torch.zeros(len(prompts), dtype=torch.long, device=self.device)  # each row's, from 0
        self.per_turn = torch.zeros(2, 1, dtype=torch.long, device=self.device)  # row-rounds, accepted

    def _count(self, rows: int, g: int, accepted: list[int]):
        super()._count(rows, g, accepted)
        turn = self.turn[self._round_rows].clamp(max=self.per_turn.shape[1] - 1)
        self.per_turn[0].index_add_(0, turn, torch.ones_like(turn))
        if self._row_accepted is not None:  # (a plain round accepts nothing)
            self.per_turn[1].index_add_(0, turn, self._row_accepted)

    def _leave(self, done: list[int], keep: list[int]):
        idx = torch.tensor(done, device=self.device)
        rows, lengths = self.rows[idx].tolist(), self.cache.lengths[idx].tolist()
        for j, (r, n) in enumerate(zip(rows, lengths)):
            one = idx[j:j + 1]
            self.parked[r] = _Parked(self.cache.take(one, span=n),
                                     None if self.draft is None else self.draft.take(self.draft_state, one),
                                     self.last[one])
        self.left += rows
        if keep:
            super()._leave(done, keep)
        else:  # every row waits: nothing to decode until one comes back
            self.rows, self.cache, self.draft_state, self.finished = self.rows[:0], None, None, True

    @torch.inference_mode()
    def rejoin(self, answers: list[tuple[int, list[int]]]):
        """Append each answered row's observation tokens to its cache (one forward for all), sample its next
        token, bring its draft state up to date, and put it back in the decode batch."""
        parts = [self.parked.pop(r) for r, _ in answers]
        dev = self.device
        rows = torch.tensor([r for r, _ in answers], device=dev)
        k = torch.tensor([len(o) for _, o in answers], device=dev)
        width = int(k.max()) + 1
        obs = torch.tensor([o + [0] * (width - len(o)) for _, o in answers], device=dev)  # (R,width)
        cache, last = KVCache.cat([p.cache for p in parts]), torch.cat([p.last for p in parts])
        counts, start = k + 1, cache.lengths.clone()
        ids = torch.cat([last[:, None], obs[:, :width - 1]], 1)  # [pending, o_1..o_k] per row, right-padded
        with self._routing() as r:
            logits, feats = self.model(ids, cache=cache, logit_index=counts - 1, taps=self.taps)  # (R,1,V)
        self._keep_routes(r, rows, start, counts)
        cache.set_lengths(start + counts)
        nxt, logp = self._sample(logits[:, 0])
        self._lap("prefill_s")
        j = torch.arange(width - 1, device=dev)
        valid = j < k[:, None]  # (R,width-1) the observation's tokens: outputs, never targets
        n_out = self.n_out[rows]
        at = (rows[:, None].expand(-1, width - 1)[valid], (n_out[:, None] + j)[valid])
        self.out_tokens[at], self.out_logp[at], self.policy_token[at] = obs[:, :width - 1][valid], 0.0, False
        self.n_out[rows] = n_out + k
        self.turn[rows] += 1
        state = None
        if self.draft is not None:
            tokens = obs.scatter(1, k[:, None], nxt[:, None])  # (R,width) [o_1..o_k, next]
            state = self.draft.extend(self.draft.join([p.draft for p in parts]), tokens, counts, feats)
            self._lap("draft_s")
        self._emit(nxt[:, None], logp[:, None], torch.ones_like(k), rows)
        b0 = self.rows.numel()
        if b0:
            self.cache = KVCache.cat([self.cache, cache])
            self.draft_state = state if state is None else self.draft.join([self.draft_state, state])
            self.rows, self.last = torch.cat([self.rows, rows]), torch.cat([self.last, nxt])
        else:
            self.cache, self.draft_state, self.rows, self.last = cache, state, rows, nxt
        self.finished = False
        done = self.done.tolist()
        if any(done):
            self._leave([b0 + i for i, d in enumerate(done) if d],
                        list(range(b0)) + [b0 + i for i, d in enumerate(done) if not d])
        self._lap("bookkeeping_s")

    def results(self) -> list[GenerationResult]:
        out = super().results()
        mask = self.policy_token.tolist()
        for r, res in enumerate(out):
            res.mask = mask[r][:len(res.tokens)]
        return out


def run_episodes(engine: Engine, prompts: list[list[int]], answers: Answers, *, max_tokens: int, max_turns: int,
                 stop: list[int], temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, eos_id=None, overlap: bool = True, progress=None
                 ) -> list[GenerationResult]:
    """One episode per prompt, up to ``max_tokens`` new tokens each (its turns and observations) and
    ``max_turns`` turns (``engine.stats``: their statistics, with τ per turn and the time spent waiting
    with no row to decode). finish_reason: "eos"
    (the environment ended it), "length" (out of tokens), "context" (an observation longer than the room
    left), "turns" (max_turns reached)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    run = engine.start(prompts, max_tokens, temperature, top_p, top_k, seed, eos_id, stop=stop, kind=TurnRollout)
    run.per_turn = torch.zeros(2, max_turns, dtype=torch.long, device=run.device)
    b = len(prompts)
    turns, begin, finish = [1] * b, [0] * b, [None] * b
    idle = 0.0

    def end(r: int, why: str):
        finish[r] = why
        run.parked.pop(r, None)

    def turns_ended():
        rows, run.left = run.left, []
        for r, n in zip(rows, run.n_out[rows].tolist() if rows else []):
            turn, begin[r] = run.out_tokens[r, begin[r]:n].tolist(), n
            if n >= max_tokens:
                end(r, "length")
            else:
                answers.submit(r, turn)

    while True:
        if not run.finished:
            run.step()
        turns_ended()
        wait = "none" if not answers.pending else "all" if not overlap else "any" if run.finished else "none"
        t0 = perf_counter()
        got = answers.ready(wait)
        idle += perf_counter() - t0 if run.finished else 0.0
        back = []
        for r, obs in got:
            n = int(run.n_out[r])
            if obs is None:
                end(r, "eos")
            elif turns[r] >= max_turns:
                end(r, "turns")
            elif n + len(obs) + 1 > max_tokens:
                end(r, "context")
            else:
                turns[r] += 1
                begin[r] = n + len(obs)
                back.append((r, obs))
        if back:
            run.rejoin(back)
            turns_ended()
        if progress is not None:
            progress(sum(f is not None for f in finish))
        if run.finished and not answers.pending and not back:
            break
    results = run.results()
    for res, why, t in zip(results, finish, turns):
        res.finish_reason, res.turns = why or "length", t
    run.stats.row_rounds_per_turn, run.stats.accepted_per_turn = run.per_turn.tolist()
    run.stats.env_wait_s = idle
    engine.stats = run.stats
    return results
