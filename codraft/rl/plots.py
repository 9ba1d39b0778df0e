"""PNG plots of a run from its metrics.jsonl (written at the end of `train` and by `codraft plot`)."""
from __future__ import annotations

from pathlib import Path

from codraft.rl.logger import read_metrics

PANELS = [
    ("reward", ["reward_mean"], "reward"),
    ("val_accuracy", ["val_accuracy"], "held-out accuracy"),
    ("acceptance", ["acceptance_length", "frozen_acceptance_length"], "acceptance length τ"),
    ("mismatch", ["mismatch_kl", "token_mult_prob_error"], "train–inference mismatch"),
    ("step_time", ["time_rollout", "time_train", "time_step"], "seconds per step"),
    # multi-turn episodes (env.name): drawn only where a run logged them
    ("episodes", ["turns_mean", "tool_calls_mean", "env_errors"], "turns and tool calls per episode, env errors"),
    ("env_time", ["time_env_wait", "time_env", "time_rollout"], "rollout, waiting on tools, inside tools (s)"),
]  # a panel is drawn when its first key was logged


SMOOTH = 10  # steps in the trailing mean drawn over long series (one step's reward is noisy)


def trailing_mean(ys: list[float], window: int = SMOOTH) -> list[float]:
    """Mean of each value and up to ``window - 1`` values before it."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _draw(ax, pts: list[tuple], label: str):
    """A series; from 3·SMOOTH points on, faint, under its trailing mean."""
    xs, ys = zip(*pts)
    if len(pts) < 3 * SMOOTH:
        ax.plot(xs, ys, marker=".", label=label)
        return
    (raw,) = ax.plot(xs, ys, alpha=0.3, linewidth=0.8)
    ax.plot(xs, trailing_mean(list(ys)), color=raw.get_color(), label=f"{label} (mean of {SMOOTH} steps)")


def check_run(run_dir: str | Path) -> list[dict]:
    """The metrics rows of a run folder that is to be plotted: a missing, malformed (``read_metrics``)
    or empty metrics.jsonl is a one-line error naming the file. (``plot_run`` itself draws nothing
    from an empty log: the trainer calls it after a run that stopped before its first step.)"""
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} is empty: the run logged no step, nothing to plot")
    return rows


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    written = []
    for name, keys, title in PANELS:
        if not any(isinstance(r.get(keys[0]), (int, float)) for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                _draw(ax, pts, key)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(run_dir) / f"{name}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


def plot_compare(run_dirs: list[str | Path], out_dir: str | Path, labels: list[str] | None = None) -> list[Path]:
    """Overlay the same panels for several runs (e.g. frozen vs co-trained draft, seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(d) for d in run_dirs]
    labels = labels or [Path(d).name for d in run_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys, title in PANELS:
        key = keys[0]
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        drawn = False
        for rows, label in zip(runs, labels):
            # each run's headline key; also the frozen copy's τ where a run probed it (same policy)
            for k, lab in ((key, label), ("frozen_" + key, f"{label}, frozen copy")):
                pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
                if pts:
                    _draw(ax, pts, lab)
                    drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(f"{title} ({key})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out = out_dir / f"compare_{name}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written


def summarize(run_dir: str | Path, last: int = 5) -> dict:
    """Headline figures of a run: means over its last ``last`` steps and totals."""
    rows = [r for r in read_metrics(run_dir) if "time_step" in r]

    def mean(key, rs):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    tail = rows[-last:]
    val = [r["val_accuracy"] for r in read_metrics(run_dir) if isinstance(r.get("val_accuracy"), (int, float))]
    return {"steps": len(rows), "reward_first": mean("reward_mean", rows[:last]), "reward_last": mean("reward_mean", tail),
            "val_first": val[0] if val else None, "val_last": val[-1] if val else None,
            "tau_first": mean("acceptance_length", rows[:last]), "tau_last": mean("acceptance_length", tail),
            "frozen_tau_first": mean("frozen_acceptance_length", rows[:last]),
            "frozen_tau_last": mean("frozen_acceptance_length", tail),
            "rollout_speedup": mean("rollout_speedup", rows), "time_rollout": mean("time_rollout", rows),
            "time_train": mean("time_train", rows), "time_step": mean("time_step", rows),
            "mismatch_kl": mean("mismatch_kl", rows), "rollout_share": (mean("time_rollout", rows) or 0) / (mean("time_step", rows) or 1)}
