"""An evaluation's figures: a dict per pass (``figures``), the JSON (``as_json``) and the table on stdout."""
from __future__ import annotations

from codraft.eval.evaluate import Evaluation, Pass


def figures(p: Pass, threshold: float, speculative: bool) -> dict:
    """Every figure of one pass; τ and the per-position acceptance only when a draft proposed."""
    st = p.stats
    out = {"mean_reward": p.mean_reward, "accuracy": p.accuracy(threshold), "samples": len(p.rewards),
           "judged": len(p.judged), "reward_errors": len(p.errors),
           "completion_len": sum(p.lengths) / len(p.lengths) if p.lengths else 0.0,
           **{f"reward/{k}_mean": v for k, v in p.function_means().items()}}
    if speculative:
        out.update(acceptance_length=st.acceptance_length, acceptance_per_position=st.acceptance_per_position)
    out.update(tokens=st.emitted_tokens, tokens_per_s=st.emitted_tokens / p.seconds if p.seconds > 0 else 0.0,
               seconds=p.seconds)
    if p.errors:
        out["first_error"] = p.errors[0]
    return out


def as_json(ev: Evaluation, speculative: bool, head: dict) -> dict:
    """``head`` (what was evaluated, the settings), then ``greedy`` and ``sampled`` (with ``pass@k``)."""
    out = dict(head)
    if ev.greedy is not None:
        out["greedy"] = figures(ev.greedy, ev.threshold, speculative)
    if ev.sampled is not None:
        out["sampled"] = {**figures(ev.sampled, ev.threshold, speculative),
                          **{f"pass@{k}": v for k, v in ev.pass_at_k.items()}}
    return out


ROWS = [("mean reward", "mean_reward", "{:.4f}"), ("accuracy", "accuracy", "{:.4f}"), ("pass@", None, "{:.4f}"),
        ("judged", "judged", None), ("reward errors", "reward_errors", "{}"),
        ("completion len", "completion_len", "{:.2f}"), ("τ (tokens/round)", "acceptance_length", "{:.3f}"),
        ("tokens/s", "tokens_per_s", "{:.1f}"), ("seconds", "seconds", "{:.2f}")]


def table(result: dict, temperature: float) -> str:
    """The passes side by side, a row per figure ('-' where a pass has none)."""
    cols = [("greedy", result["greedy"])] if "greedy" in result else []
    if "sampled" in result:
        s = result["sampled"]
        cols.append((f"T={temperature:g}, n={s['samples'] // max(result['settings']['prompts'], 1)}", s))
    ks = [k for k in result.get("sampled", {}) if k.startswith("pass@")]
    lines = []
    for label, key, fmt in ROWS:
        for label, key in ([(k, k) for k in ks] if key is None else [(label, key)]):
            if fmt is None:
                cells = [f"{c['judged']}/{c['samples']}" for _, c in cols]
            else:
                cells = [fmt.format(c[key]) if key in c else "-" for _, c in cols]
            if key == "acceptance_length" and all(c == "-" for c in cells):
                continue  # plain decoding: no τ
            lines.append(f"{label:<18}" + "".join(f"{c:>16}" for c in cells))
    names = [k.removeprefix("reward/").removesuffix("_mean") for k in result.get("greedy", result.get("sampled", {}))
             if k.startswith("reward/")]
    if len(names) > 1:  # each function's own mean
        for n in names:
            lines.append(f"{'  ' + n:<18}" + "".join(f"{c.get(f'reward/{n}_mean', float('nan')):>16.4f}"
                                                     for _, c in cols))
    return "\n".join([f"{'':<18}" + "".join(f"{h:>16}" for h, _ in cols), *lines])
