"""Acceptance and timing statistics of one ``Engine.generate`` call.

Counting conventions:
  * a *round* is one batched verify forward (plain decoding, or a round that drafts g = 0
    tokens: one decode step); ``row_rounds`` sums the active rows over rounds; every active
    row of a round drafts the same g tokens (γ, or with gamma="auto" the round's choice);
  * ``gamma_chosen[g]`` counts the rounds that drafted g tokens (g = 0..γ; empty without a draft);
  * ``drafted_per_position[k-1]`` counts the row-rounds that drafted position k (g >= k), and
    ``accepted_per_position[k-1]`` those among them that accepted at least k tokens;
  * ``accepted`` counts draft tokens accepted by the rule, before any truncation at EOS
    or max_new_tokens (it measures the draft, not the stop criteria);
  * acceptance_length τ = 1 + accepted / row_rounds: mean tokens a row gains per round,
    bonus/correction included (1.0 for plain decoding; g = 0 rounds count as 1);
  * acceptance_per_position[k-1] = P(draft token k accepted) over the row-rounds that drafted
    position k (unconditional, so non-increasing for a fixed γ, where τ = 1 + Σ_k of it);
  * mean_gamma = drafted / row_rounds: tokens drafted per row-round;
  * emitted_tokens counts the tokens actually returned (the prefill's first token included; in multi-turn
    episodes the observations' too);
  * times are host perf_counter seconds. On an accelerator the split between phases is
    only exact with ``Engine(..., timing_sync=True)`` (a device sync per phase); the total
    is always exact because results are copied to the host at the end.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    gamma: int = 0
    rounds: int = 0
    row_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    gamma_chosen: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + sampling/accept rule (plain: decode forward + sampling)
    bookkeeping_s: float = 0.0  # stop criteria, output writes, cache rollback, host sync, row dropping
    total_s: float = 0.0
    # multi-turn episodes (codraft.rollout.turns): rounds and accepted draft tokens by the row's turn
    # (0 = the first), and the time no row could decode, every one waiting on its environment
    row_rounds_per_turn: list[int] = field(default_factory=list)
    accepted_per_turn: list[int] = field(default_factory=list)
    env_wait_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.row_rounds if self.row_rounds else 1.0

    @property
    def acceptance_length_per_turn(self) -> list[float]:
        """τ of the rounds in each turn of multi-turn episodes."""
        return [1.0 + a / r if r else 1.0 for a, r in zip(self.accepted_per_turn, self.row_rounds_per_turn)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_gamma(self) -> float:
        return self.drafted / self.row_rounds if self.row_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted_tokens / self.total_s if self.total_s > 0 else 0.0

    @classmethod
    def pool(cls, stats: list["SpecStats"]) -> "SpecStats":
        """Several runs' statistics as one (repetitions, or the shares of ranks that split a batch):
        counts and times summed, per-position lists summed elementwise, rates recomputed."""
        if not stats:
            return cls()
        summed = {}
        for f in dataclasses.fields(cls):
            if f.name == "gamma":
                continue
            vals = [getattr(s, f.name) for s in stats]
            if isinstance(vals[0], list):
                width = max(len(v) for v in vals)
                summed[f.name] = [sum(v[i] for v in vals if i < len(v)) for i in range(width)]
            else:
                summed[f.name] = sum(vals)
        return cls(gamma=max(s.gamma for s in stats), **summed)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("acceptance_length", "acceptance_length_per_turn", "acceptance_rate", "acceptance_per_position", "mean_gamma", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d

    def __getitem__(self, key: str):
        return self.as_dict()[key]
