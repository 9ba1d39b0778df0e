"""τ of a run's co-trained draft vs the frozen initial draft, on the run's final policy, fixed γ.

Usage: python scripts/drift_after_run.py RUN_DIR [STEP]   (docs/real-preset.md)
The probes logged during an `auto` run share its adaptive draft length, which drafts little
when speculation does not pay; this measures both drafts at a fixed γ on held-out prompts.
"""
import json
import sys
from pathlib import Path

import torch

from codraft.config import load_config
from codraft.drafts import init_draft
from codraft.policy import load_policy
from codraft.rollout import Engine
from codraft.tasks import make_task
from codraft.train.offline_draft import starting_draft


def main(run_dir: str, step: int | None = None, prompts: int = 32, seeds: int = 3):
    run = Path(run_dir)
    step = step or max(int(p.name.split("_")[1]) for p in run.glob("step_*") if p.is_dir())
    cfg = load_config(str(run / "config.yaml"))
    d = cfg.draft
    policy, tok, folder = load_policy(str(run / f"step_{step}" / "policy"))
    base, _, base_dir = load_policy(cfg.policy.init)
    task = make_task(cfg.task.name)
    frozen = starting_draft(d.kind, d.init, policy=base, tok=tok, task=task, policy_dir=base_dir, gamma=d.gamma,
                            seed=cfg.seed)
    trained = init_draft(d.kind, policy, gamma=d.gamma)
    trained.load_state_dict(torch.load(run / f"step_{step}" / "draft.pt", weights_only=True))
    frozen.bind_target(policy.embed_tokens.weight, policy.head_weight)  # both read the final policy
    problems = task.sample("val", prompts, seed=0)
    ids = [tok.prompt_ids(p.prompt) for p in problems]
    for name, draft in (("frozen", frozen), ("cotrained", trained)):
        engine = Engine(policy, draft, d.gamma)
        acc = drafted = rows = 0
        per = [0] * d.gamma
        for s in range(seeds):
            engine.generate(ids, cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, seed=1 + s,
                            eos_id=tok.eos_id)
            st = engine.stats
            acc, rows = acc + st.accepted, rows + st.row_rounds
            per = [a + b for a, b in zip(per, st.accepted_per_position)]
            drafted = [x + y for x, y in zip(drafted or [0] * d.gamma, st.drafted_per_position)]
        print(json.dumps({"draft": name, "step": step, "gamma": d.gamma, "tau": 1 + acc / rows,
                          "acceptance_per_position": [a / max(n, 1) for a, n in zip(per, drafted)]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
