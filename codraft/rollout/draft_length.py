"""How many tokens to draft each round (``Engine(..., gamma="auto")``): a cost model and a rule.

Each round the engine picks g in 0..γ_max (g = 0: a plain target step of width 1, the draft only
commits the new token) to maximise the expected tokens per second of the round:

    E(g) = 1 + Σ_{k≤g} a_k                                    tokens a row gains (bonus included)
    g*   = argmax_g  E(g) / (T_target(rows, g+1) + T_draft(rows, g))

a_k = P(draft position k accepted), unconditional (non-increasing), estimated by
``AcceptanceEstimate`` from the rounds so far; T_target(rows, t) is one target forward of t tokens
per row with its sampling or acceptance rule, T_draft(rows, g) the rest of the round: the draft's
propose(g), its commit of g+1 tokens (g = 0: keeping the token for later), the bookkeeping; both
priced at the round's context length. The rule reads only the past (row count, earlier verdicts,
context length), never a clock, so the emitted tokens keep exactly the target's distribution and a
seed repeats a run.

``CostModel`` holds those times measured on the device at hand (``calibrate``: the engine's own rounds
at rows 1, 2, 4, … up to the batch, each g in 0..γ_max, best of a few repeats, linear in rows between
grid points; a round's target part is its forward with the sampling or acceptance rule, its draft part
everything else it pays). ``load_or_calibrate`` caches it as JSON under ``cache_root()/calibration/``,
keyed by the model (config, dtype, class), the draft (kind, shapes), the device, torch's thread count,
the CPU or GPU name and ``CODRAFT_KERNELS``; a file recorded elsewhere, or unreadable, is recalibrated.
docs/draft-length.md has the details.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Callable, Sequence

import torch
import torch.nn as nn

from codraft.cache import cache_root

FORMAT = 2  # bump when the file layout or what is timed changes: old files are recalibrated (2: engine
# rounds at two context lengths)
# prompt tokens per row of the two calibrations (the rounds then grow each by up to ~100): a rollout's
# context runs from its prompt (~100 tokens for the real preset) to prompt + completion
CONTEXTS = (64, 256)


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
    target_s: tuple[tuple[float, ...], ...]  # [i][t-1]: a round's target forward of rows[i] x t tokens + its rule
    draft_s: tuple[tuple[float, ...], ...]   # [i][g]: the rest of a round drafting g at rows[i]

    @property
    def max_gamma(self) -> int:
        return len(self.draft_s[0]) - 1

    def target(self, rows: int, tokens: int) -> float:
        return _interpolate(self.rows, [r[tokens - 1] for r in self.target_s], rows)

    def draft(self, rows: int, g: int) -> float:
        return _interpolate(self.rows, [r[g] for r in self.draft_s], rows)

    def at(self, context: int) -> "CostModel":
        return self  # timed at one context length: flat in it


@dataclass(frozen=True)
class ContextCosts:
    """Cost models timed at increasing context lengths (``contexts``, tokens per row); ``at(context)``
    prices a round at that context, linear in between and beyond. A round's attention reads every row's
    context: SmolLM2's bf16 forwards cost 9-21 % more at 256 tokens than at 64 (session 28), and the
    rounds where the choice is close (2-4 rows left) come late in a rollout."""
    contexts: tuple[int, ...]
    models: tuple[CostModel, ...]

    @property
    def rows(self) -> tuple[int, ...]:
        return self.models[0].rows

    @property
    def max_gamma(self) -> int:
        return self.models[0].max_gamma

    def at(self, context: int) -> "_AtContext":
        return _AtContext(self, context)


@dataclass(frozen=True)
class _AtContext:
    costs: ContextCosts
    context: int

    def target(self, rows: int, tokens: int) -> float:
        return _interpolate(self.costs.contexts, [m.target(rows, tokens) for m in self.costs.models], self.context)

    def draft(self, rows: int, g: int) -> float:
        return _interpolate(self.costs.contexts, [m.draft(rows, g) for m in self.costs.models], self.context)


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


def calibrate(model: nn.Module, max_gamma: int, rows: int, *, start: Callable, repeats: int = 3,
              contexts: Sequence[int] = CONTEXTS) -> ContextCosts:
    """Time the engine's own rounds on the model's device: per context length c and grid row count b, a
    rollout of b random prompts of c tokens, ``start(prompts, max_new)`` (the engine's: T = 1, EOS off,
    a fixed γ = max_gamma so that no estimate is touched), stepped with each g in 0..max_gamma in turn.
    A round's target part is its ``verify_s`` (the forward with its sampling or acceptance rule), its
    draft part the rest (propose, commit, bookkeeping, the host sync): what the rule prices is what a
    rollout pays, not bare calls. Best of ``repeats`` passes over all cells after a warm-up pass
    (interleaved, so a slow spell of the machine spreads over all cells instead of skewing a few), each
    part's minimum on its own; a progress line on stderr. Prompts and samples come from private
    generators: the global RNG is untouched. Contexts longer than the model allows are cut to fit."""
    dev = next(model.parameters()).device
    room = (repeats + 1) * (max_gamma + 1) ** 2  # the most tokens the passes emit per row
    max_len = model.config.max_position_embeddings
    if room >= max_len:
        raise ValueError(f"calibrating {max_gamma} drafts a round needs more than the {max_len} positions the "
                         f"model allows")
    prompt_lens = sorted({max(1, min(c, max_len - room)) for c in contexts})
    gen = torch.Generator(device=dev).manual_seed(0)
    grid = row_grid(rows)
    runs = {(c, b): start(torch.randint(model.config.vocab_size, (b, c), generator=gen, device=dev).tolist(), room)
            for c in prompt_lens for b in grid}
    cells = [(c, b, g) for c in prompt_lens for b in grid for g in range(max_gamma + 1)]
    best = {cell: [math.inf, math.inf] for cell in cells}  # -> [target s, draft s]
    start, n = perf_counter(), len(cells) * (repeats + 1)
    for p in range(repeats + 1):  # pass 0 warms up
        for j, (c, b, g) in enumerate(cells):
            run = runs[c, b]
            s = run.stats
            before = s.verify_s, s.draft_s + s.bookkeeping_s
            run.resume()  # other cells ran since this rollout's last round
            run.step(g)
            if p:
                part = best[c, b, g]
                part[0] = min(part[0], s.verify_s - before[0])
                part[1] = min(part[1], s.draft_s + s.bookkeeping_s - before[1])
            if sys.stderr.isatty():
                print(f"\rcalibrating draft length on {dev}: {p * len(cells) + j + 1}/{n} rounds", end="",
                      file=sys.stderr, flush=True)
    print(f"\rcalibrating draft length on {dev}: {n}/{n} rounds in {perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    models = tuple(CostModel(tuple(grid), *(tuple(tuple(best[c, b, g][part] for g in range(max_gamma + 1))
                                                  for b in grid) for part in (0, 1)))
                   for c in prompt_lens)
    return ContextCosts(tuple(c + room // 2 for c in prompt_lens), models)  # a cell's context, on average


def _sync(device: torch.device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


# ---- the cache -----------------------------------------------------------------------------------


def machine_key(device: torch.device) -> dict:
    """What a timing depends on besides the model and draft: device, threads, processor, kernels."""
    return {"device": str(device), "threads": torch.get_num_threads(), "processor": _processor(device),
            "kernels": os.environ.get("CODRAFT_KERNELS")}


def _processor(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def load_or_calibrate(model: nn.Module, draft, max_gamma: int, rows: int, *, start: Callable,
                      folder: str | os.PathLike | None = None) -> ContextCosts:
    """The cached cost model of (model, draft, this machine) covering ``rows`` rows, else a fresh
    calibration (written back) of the rollouts ``start`` begins (``calibrate``; ``Engine.calibrate``
    passes its own). A file recorded for another key, with a grid too small, or unreadable (warned) is
    recalibrated."""
    key = json.loads(json.dumps(signature(model, draft, max_gamma), default=str))  # as JSON reads it back
    folder = Path(folder) if folder is not None else cache_root() / "calibration"
    path = folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    cached = _read(path, key)
    if cached is not None and cached.rows[-1] >= rows:
        return cached
    cost = calibrate(model, max_gamma, max(rows, cached.rows[-1] if cached else 1), start=start)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, **dataclasses.asdict(cost)}, indent=1))  # contexts, models
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    return cost


def _read(path: Path, key: dict) -> ContextCosts | None:
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if d["key"] != key:
            warnings.warn(f"{path} was recorded for another setting (machine {d['key'].get('machine')}; this one "
                          f"is {key['machine']}): recalibrating", stacklevel=3)
            return None
        models = tuple(CostModel(tuple(m["rows"]), tuple(map(tuple, m["target_s"])), tuple(map(tuple, m["draft_s"])))
                       for m in d["models"])
        cost = ContextCosts(tuple(d["contexts"]), models)
        if not (models and len(cost.contexts) == len(models) and all(
                m.rows == cost.rows and len(m.target_s) == len(m.draft_s) == len(m.rows) and all(
                    len(r) == key["max_gamma"] + 1 for r in m.target_s + m.draft_s) for m in models)):
            raise ValueError("grid shapes do not match")
        return cost
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"unreadable draft-length calibration {path} ({type(e).__name__}: {e}): recalibrating",
                      stacklevel=3)
        return None
