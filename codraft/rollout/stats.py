"""Acceptance and timing statistics of one ``Engine.generate`` call.

Counting conventions:
  * a *round* is one batched verify forward (plain decoding: one decode step);
    ``row_rounds`` sums the active rows over rounds (every active row drafts γ tokens);
  * ``accepted`` counts draft tokens accepted by the rule, before any truncation at EOS
    or max_new_tokens (it measures the draft, not the stop criteria);
  * acceptance_length τ = 1 + accepted / row_rounds: mean tokens a row gains per verify
    round, bonus/correction included (1.0 for plain decoding);
  * acceptance_per_position[k-1] = P(draft token k accepted) = fraction of row-rounds with
    at least k accepted (unconditional, so it is non-increasing and τ = 1 + Σ_k of it);
  * emitted_tokens counts the tokens actually returned (the prefill's first token included);
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
    emitted_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forward + sampling/accept rule (plain: decode forward + sampling)
    bookkeeping_s: float = 0.0  # stop criteria, output writes, cache rollback, host sync, row dropping
    total_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.row_rounds if self.row_rounds else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.row_rounds if self.row_rounds else 0.0 for a in self.accepted_per_position]

    @property
    def tokens_per_s(self) -> float:
        return self.emitted_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("acceptance_length", "acceptance_rate", "acceptance_per_position", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d

    def __getitem__(self, key: str):
        return self.as_dict()[key]
