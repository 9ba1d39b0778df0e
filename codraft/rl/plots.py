"""PNG plots of a run from its metrics.jsonl (written at the end of `train` and by `codraft plot`)."""
from __future__ import annotations

from pathlib import Path

from codraft.rl.logger import read_metrics

PANELS = [
    ("reward", ["reward_mean"], "reward"),
    ("val_accuracy", ["val_accuracy"], "held-out accuracy"),
    ("acceptance", ["acceptance_length"], "acceptance length τ"),
    ("mismatch", ["mismatch_kl", "token_mult_prob_error"], "train–inference mismatch"),
    ("step_time", ["time_rollout", "time_train", "time_step"], "seconds per step"),
]


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    written = []
    for name, keys, title in PANELS:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=key)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(run_dir) / f"{name}.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        written.append(out)
    return written
