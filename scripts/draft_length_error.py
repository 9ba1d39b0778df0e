"""How far the adaptive draft length's cost model is from the rounds it prices (docs/draft-length.md,
docs/real-preset.md session 27): SmolLM2's bf16 rollout copy with its offline DSpark draft, ``gamma=auto``,
rollouts at T = 1 of 16 held-out prompts B at a time; per (live rows, chosen g), the rounds' measured
ms (the target's verify or plain step with its sampling; the draft's propose + commit with the round's
bookkeeping) next to what ``CostModel`` predicts for them. The rule compares rates across g at one row
count, so what matters is whether the errors differ between g's.

Usage: python scripts/draft_length_error.py [BATCH] [REPEATS]   (default 8 2; ~2 minutes)
"""
import sys
from collections import defaultdict

from codraft.bench.spec import _prompts
from codraft.rollout import Engine, load_or_calibrate

from rollout_ab import smollm2_dspark  # (this folder)


def main(batch: int = 8, repeats: int = 2) -> None:
    tok, weights, draft = smollm2_dspark()
    target, draft = weights.policy, weights.draft_for(draft)
    cost = load_or_calibrate(target, draft, draft.default_gamma, batch)
    engine = Engine(target, draft, "auto", cost_model=cost)
    prompts = _prompts(tok, 16)
    engine.generate(prompts[:batch], 16, temperature=1.0, eos_id=[tok.eos_id], seed=0)  # warm-up
    cells = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])  # (rows, g) -> rounds, verify, draft, their predictions
    for rep in range(repeats):
        for i in range(0, len(prompts), batch):
            run = engine.start(prompts[i:i + batch], 128, temperature=1.0, eos_id=[tok.eos_id],
                               seed=1 + i + len(prompts) * rep)
            while not run.finished:
                rows = run.rows.numel()
                g = run.draft_length(rows)
                s = run.stats
                before = s.verify_s, s.draft_s + s.bookkeeping_s
                run.step()
                c = cells[rows, g]
                c[0] += 1
                c[1] += s.verify_s - before[0]
                c[2] += s.draft_s + s.bookkeeping_s - before[1]
                c[3] += cost.target(rows, g + 1)
                c[4] += cost.draft(rows, g)
    print(f"batch {batch}: ms a round, measured (cost model); acceptance estimate at the end "
          f"{[round(a, 2) for a in engine.acceptance.values()]}")
    print("rows  g  rounds  target        draft + bookkeeping")
    for (rows, g), (n, v, d, pv, pd) in sorted(cells.items()):
        print(f"{rows:4d}  {g}  {n:6d}  {1e3 * v / n:5.1f} ({1e3 * pv / n:5.1f})  "
              f"{1e3 * d / n:5.2f} ({1e3 * pd / n:5.2f})")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
