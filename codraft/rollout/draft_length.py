"""How many tokens to draft each round (``Engine(..., gamma="auto")``): a cost model and a rule.

Each round the engine picks g in 0..γ_max (g = 0: a plain target step of width 1, the draft only
commits the new token) to maximise the expected tokens per second of the round:

    E(g) = 1 + Σ_{k≤g} a_k                                    tokens a row gains (bonus included)
    g*   = argmax_g  E(g) / (T_target(rows, g+1) + T_draft(rows, g))

a_k = P(draft position k accepted), unconditional (non-increasing), estimated by
``AcceptanceEstimate`` from the rounds so far; T_target(rows, t) is one target forward of t tokens
per row, T_draft(rows, g) the draft's propose(g) plus its commit of g+1 tokens (g = 0: the commit
alone). The rule reads only the past (row count, earlier verdicts), never a clock, so the emitted
tokens keep exactly the target's distribution and a seed repeats a run.

``CostModel`` holds those times measured on the device at hand (``calibrate``: real forwards over
rows 1, 2, 4, … up to the batch × tokens 1..γ_max+1, best of a few repeats, linear in rows between
grid points). ``load_or_calibrate`` caches it as JSON under ``cache_root()/calibration/``, keyed by
the model (config, dtype, class), the draft (kind, shapes), the device, torch's thread count, the
CPU or GPU name, the CPU's feature flags and ``CODRAFT_KERNELS``; a file recorded elsewhere, or
unreadable, is recalibrated.
docs/draft-length.md has the details.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Sequence

import torch
import torch.nn as nn

from codraft import cache
from codraft.cache import cache_root
from codraft.models import KVCache
from codraft.spec.sampling import Sampler

FORMAT = 1  # bump when the file layout or what is timed changes: old files are recalibrated
CONTEXT = 64  # context tokens per row while timing (cost is taken as flat in the context length)


# ---- the rule ----------------------------------------------------------------------------------


def choose(rows: int, acceptance: Sequence[float], cost) -> int:
    """The g in 0..len(acceptance) with the most expected tokens per second; ties go to the smaller g.

    acceptance[k-1] = a_k; cost: anything with ``target(rows, tokens)`` and ``draft(rows, g)`` seconds.
    """
    best, best_rate, expected = 0, 0.0, 1.0
    for g in range(len(acceptance) + 1):
        expected += acceptance[g - 1] if g else 0.0
        rate = expected / (cost.target(rows, g + 1) + cost.draft(rows, g))
        if rate > best_rate:
            best, best_rate = g, rate
    return best


class AcceptanceEstimate:
    """Running a_k = P(draft position k accepted), over the row-rounds that drafted position k.

    Counts start from ``weight`` pseudo-row-rounds at ``prior``^k (optimistic: the first rounds
    speculate) and fade by ``decay`` per round, so the estimate follows a draft that co-training
    improves, and a position no longer drafted drifts back to the prior and is tried again.
    Kept across ``generate`` calls by the engine; ``state_dict`` lets a resumed run continue it.
    """

    def __init__(self, max_gamma: int, *, prior: float = 0.8, weight: float = 4.0, decay: float = 0.98):
        self.prior = [weight * prior ** k for k in range(1, max_gamma + 1)]
        self.weight, self.decay = weight, decay
        self.drafted = [0.0] * max_gamma
        self.accepted = [0.0] * max_gamma

    def values(self) -> list[float]:
        """a_1..a_γmax, made non-increasing (a row that accepted k tokens accepted every earlier one)."""
        out, last = [], 1.0
        for p, a, d in zip(self.prior, self.accepted, self.drafted):
            last = min(last, (p + a) / (self.weight + d))
            out.append(last)
        return out

    def observe(self, rows: int, accepted: Sequence[int]):
        """One round of ``rows`` rows that drafted g = len(accepted) tokens; accepted[k-1] rows accepted >= k."""
        self.drafted = [d * self.decay for d in self.drafted]
        self.accepted = [a * self.decay for a in self.accepted]
        for k, n in enumerate(accepted):
            self.drafted[k] += rows
            self.accepted[k] += n

    def state_dict(self) -> dict:
        return {"drafted": list(self.drafted), "accepted": list(self.accepted)}

    def load_state_dict(self, state: dict):
        if len(state["drafted"]) != len(self.drafted) or len(state["accepted"]) != len(self.accepted):
            raise ValueError(f"acceptance counts for {len(state['drafted'])} positions, this engine drafts "
                             f"up to {len(self.drafted)}")
        self.drafted, self.accepted = [float(x) for x in state["drafted"]], [float(x) for x in state["accepted"]]


# ---- the cost model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Seconds of one round's parts at the calibrated row counts, linear in rows in between."""
    rows: tuple[int, ...]                  # ascending row counts of the grid
    target_s: tuple[tuple[float, ...], ...]  # [i][t-1]: target forward of rows[i] rows x t tokens
    draft_s: tuple[tuple[float, ...], ...]   # [i][g]: draft propose(g) + commit(g+1) at rows[i]

    @property
    def max_gamma(self) -> int:
        return len(self.draft_s[0]) - 1

    def target(self, rows: int, tokens: int) -> float:
        return _interpolate(self.rows, [r[tokens - 1] for r in self.target_s], rows)

    def draft(self, rows: int, g: int) -> float:
        return _interpolate(self.rows, [r[g] for r in self.draft_s], rows)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys); beyond the ends, the nearest segment extended (never < 0)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def row_grid(rows: int) -> list[int]:
    """1, 2, 4, … up to the first power of two >= rows."""
    grid = [1]
    while grid[-1] < rows:
        grid.append(grid[-1] * 2)
    return grid


@torch.inference_mode()
def calibrate(model: nn.Module, draft, max_gamma: int, rows: int, *, repeats: int = 3,
              context: int = CONTEXT) -> CostModel:
    """Time real target forwards and draft propose+commit rounds on the model's device, best of
    ``repeats`` passes over the whole grid after a warm-up pass (interleaved, so a slow spell of the
    machine spreads over all cells instead of skewing a few), with a progress line on stderr.
    Random tokens and features come from a private generator: the global RNG is untouched."""
    dev = next(model.parameters()).device
    rand = _Random(model, draft.feature_layers, dev)
    grid = row_grid(rows)
    target_cells, draft_cells = [], []  # [row index][tokens - 1], [row index][g]: calls to time
    for b in grid:
        cache = KVCache.for_model(model, b, context + max_gamma + 1)
        target_cells.append([_target_forward(model, draft, cache, rand.ids(b, t), context)
                             for t in range(1, max_gamma + 2)])
        rounds = _DraftRounds(draft, rand, b, context, room=(max_gamma + 1) * (repeats + 1) + max_gamma + 2)
        draft_cells.append([functools.partial(rounds.run, rand.ids(b, g + 1), rand.features(b, g + 1))
                            for g in range(max_gamma + 1)])
    cells = [fn for row in target_cells + draft_cells for fn in row]
    best = [math.inf] * len(cells)
    start, n = perf_counter(), len(cells) * (repeats + 1)
    for p in range(repeats + 1):  # pass 0 warms up
        for i, fn in enumerate(cells):
            _sync(dev)
            t0 = perf_counter()
            fn()
            _sync(dev)
            if p:
                best[i] = min(best[i], perf_counter() - t0)
            if sys.stderr.isatty():
                print(f"\rcalibrating draft length on {dev}: {p * len(cells) + i + 1}/{n} timings", end="",
                      file=sys.stderr, flush=True)
    print(f"\rcalibrating draft length on {dev}: {n}/{n} timings in {perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    width = max_gamma + 1
    table = [tuple(best[i:i + width]) for i in range(0, len(best), width)]
    return CostModel(tuple(grid), tuple(table[:len(grid)]), tuple(table[len(grid):]))


class _Random:
    """Token ids and target features of the right shapes, from a private generator."""

    def __init__(self, model: nn.Module, layers, device: torch.device):
        self.vocab, self.hidden = model.config.vocab_size, model.config.hidden_size
        self.dtype, self.layers, self.device = next(model.parameters()).dtype, tuple(layers), device
        self.gen = torch.Generator(device=device).manual_seed(0)

    def ids(self, b: int, t: int) -> torch.Tensor:
        return torch.randint(self.vocab, (b, t), generator=self.gen, device=self.device)

    def features(self, b: int, t: int) -> dict:
        return {l: torch.randn(b, t, self.hidden, generator=self.gen, device=self.device, dtype=self.dtype)
                for l in self.layers}


def _target_forward(model: nn.Module, draft, cache: KVCache, ids: torch.Tensor, context: int):
    """A call running the verify forward of ids (B,t) over ``cache`` holding ``context`` tokens per row."""
    start = torch.full((ids.shape[0],), context, device=ids.device)
    taps = tuple(draft.feature_layers)

    def run():
        cache.set_lengths(start, span=context)
        model(ids, cache=cache, taps=taps)
    return run


class _DraftRounds:
    """A draft state of b rows begun through the public interface; ``run`` is one round: propose g
    tokens (none when g = 0), then commit g + 1, of which 1 counts, so the context grows by one."""

    def __init__(self, draft, rand: _Random, b: int, context: int, room: int):
        self.draft, self.length = draft, context + 1
        self.state = draft.begin(rand.ids(b, context + 1), torch.full((b,), context + 1, device=rand.device),
                                 rand.features(b, context), max_len=context + room)
        self.ones = torch.ones(b, dtype=torch.long, device=rand.device)
        self.sampler = Sampler(1.0, generator=torch.Generator(device=rand.device).manual_seed(0))  # RL: sampling

    def run(self, tokens: torch.Tensor, features: dict):
        g = tokens.shape[1] - 1
        if g:
            self.draft.propose(self.state, g, self.sampler, context_len=self.length)
        self.state = self.draft.commit(self.state, tokens, self.ones, features)
        self.length += 1


def _sync(device: torch.device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


# ---- the cache -----------------------------------------------------------------------------------


def machine_key(device: torch.device) -> dict:
    """What a timing depends on besides the model and draft: the machine (``cache.machine_key``) and
    whether the decode kernels are on."""
    return {**cache.machine_key(device), "kernels": os.environ.get("CODRAFT_KERNELS")}


def signature(model: nn.Module, draft, max_gamma: int) -> dict:
    """The cache key: model, draft and machine."""
    shapes = sorted((k, list(v.shape), str(v.dtype)) for k, v in draft.state_dict().items()) \
        if isinstance(draft, nn.Module) else sorted((k, v) for k, v in vars(draft).items()
                                                    if isinstance(v, (bool, int, float, str)))
    return {
        "format": FORMAT,
        "model": {"class": type(model).__name__, "dtype": str(next(model.parameters()).dtype),
                  "config": dataclasses.asdict(model.config),
                  "decode_path": getattr(model, "decode_path", "reference")},  # the kernels' build, if any
        "draft": {"class": type(draft).__name__, "feature_layers": list(draft.feature_layers),
                  "tensors": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]},
        "max_gamma": max_gamma,
        "machine": machine_key(next(model.parameters()).device),
    }


def load_or_calibrate(model: nn.Module, draft, max_gamma: int, rows: int, *,
                      folder: str | os.PathLike | None = None) -> CostModel:
    """The cached cost model of (model, draft, this machine) covering ``rows`` rows, else a fresh
    calibration (written back). A file recorded for another key, with a grid too small, or
    unreadable (warned) is recalibrated."""
    folder = Path(folder) if folder is not None else cache_root() / "calibration"
    key, path = cache.keyed_file(folder, signature(model, draft, max_gamma))
    cached = _read(path, key)
    if cached is not None and cached.rows[-1] >= rows:
        return cached
    cost = calibrate(model, draft, max_gamma, max(rows, cached.rows[-1] if cached else 1))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, **dataclasses.asdict(cost)}, indent=1))
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    return cost


def _read(path: Path, key: dict) -> CostModel | None:
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if d["key"] != key:
            warnings.warn(f"{path} was recorded for another setting (machine {d['key'].get('machine')}; this one "
                          f"is {key['machine']}): recalibrating", stacklevel=3)
            return None
        cost = CostModel(tuple(d["rows"]), tuple(map(tuple, d["target_s"])), tuple(map(tuple, d["draft_s"])))
        if not (len(cost.target_s) == len(cost.draft_s) == len(cost.rows) and cost.max_gamma == key["max_gamma"]
                and all(len(r) == key["max_gamma"] + 1 for r in cost.target_s + cost.draft_s)):
            raise ValueError("grid shapes do not match")
        return cost
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"unreadable draft-length calibration {path} ({type(e).__name__}: {e}): recalibrating",
                      stacklevel=3)
        return None
