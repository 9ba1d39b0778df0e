"""Which calls cross between codraft/rl and codraft/parallel during one ``Trainer.update``: the path a rollout
token takes through the update, traced with ``sys.setprofile``.

Usage: python scripts/update_walk.py [key=value ...]           (one process; e.g. parallel.microbatches=2)
       torchrun --nproc-per-node 2 scripts/update_walk.py parallel.cp=2 rollout.prompts_per_step=2
The tiny preset (validation, probes and checkpoints off, a random draft): one step, then step 1's rollout
and score untraced, then its update traced. Prints rank 0's JSON: every distinct (caller -> callee) pair of
functions whose modules are in the two packages, each way, and how many such calls there were.
"""
import collections
import json
import os
import sys
import tempfile

from codraft.config import load_config
from codraft.rl.trainer import Trainer

PACKAGES = ("rl", "parallel")


def package(code) -> str | None:
    parts = code.co_filename.replace(os.sep, "/").split("/")
    return parts[-2] if len(parts) > 2 and parts[-3] == "codraft" and parts[-2] in PACKAGES else None


def walk(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [f"run_dir={tmp}/run", "steps=2", "log.val_every=0", "log.speedup_every=0",
                                 "log.checkpoint_every=0", "draft.init=random", *overrides])
        tr = Trainer(cfg, progress=False)
        tr.step(0)
        rollout = tr.rollout(1)
        scored = tr.score(1, rollout)
        edges = collections.Counter()

        def profile(frame, event, arg):
            if event == "call" and frame.f_back is not None:
                a, b = package(frame.f_back.f_code), package(frame.f_code)
                if a and b and a != b:
                    edges[f"{a}.{frame.f_back.f_code.co_name}", f"{b}.{frame.f_code.co_name}"] += 1
        sys.setprofile(profile)
        try:
            tr.update(1, rollout, scored)
        finally:
            sys.setprofile(None)
        tr.logger.close()
    return {"overrides": overrides, "calls": sum(edges.values()),
            **{f"{a}_to_{b}": sorted(" -> ".join(e) for e in edges if e[0].startswith(a + "."))
               for a, b in (PACKAGES, PACKAGES[::-1])}}


if __name__ == "__main__":
    out = walk(sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(out, indent=1))
