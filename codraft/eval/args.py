"""The ``codraft eval`` arguments (argparse only: ``codraft --help`` stays instant)."""
from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("eval", help="mean reward, accuracy, pass@k and τ of a run's checkpoint or a policy on prompts")
    s.add_argument("model", metavar="MODEL_OR_RUN",
                   help="a run folder (its newest checkpoint that verifies), RUN/step_N, a policy name or HF folder")
    s.add_argument("--data", metavar="FILE", help="prompts: a .jsonl/.json/.parquet/.csv file or save_to_disk folder "
                                                  "(default: the run's validation prompts)")
    s.add_argument("--task", help="prompts from a built-in task's held-out split instead (arith, chain_sum, ...)")
    s.add_argument("--reward", metavar="FUNCS", help="reward.funcs: math, exact, regex, a task's name, FILE.py:NAME, "
                                                     "module:NAME, comma-separated (default: the run's)")
    s.add_argument("--trust-run-rewards", action="store_true",
                   help="import and run the reward code (FILE.py:NAME, module:NAME) a run's config names (a run "
                        "folder is not trusted without it; --reward names your own instead)")
    s.add_argument("--limit", type=int, help="evaluate the first N prompts (default: every row of --data; the run's "
                                             "log.val_size validation prompts)")
    s.add_argument("--samples", type=int, default=0, help="n samples per prompt at --temperature, for pass@k "
                                                          "(default 0: greedy only)")
    s.add_argument("--temperature", type=float, default=1.0, help="of the --samples (default 1)")
    s.add_argument("--k", help="pass@k for these k, comma-separated (default: powers of two up to n, and n)")
    s.add_argument("--threshold", type=float, default=1.0,
                   help="a sample is solved when its reward reaches this (accuracy, pass@k; default 1)")
    s.add_argument("--no-greedy", dest="greedy", action="store_false", help="skip the greedy pass")
    s.add_argument("--draft", help="none, a draft kind (ngram, ...) or a draft folder (default: a run's own "
                                   "co-trained draft; plain decoding for a policy)")
    s.add_argument("--draft-init", default="offline", choices=("offline", "random"),
                   help="a trained --draft kind: cached short offline training, or untrained")
    s.add_argument("--gamma", help="tokens drafted per round, or auto (default: the run's; 4)")
    s.add_argument("--max-new-tokens", type=int, help="default: the run's rollout.max_new_tokens")
    s.add_argument("--batch-size", type=int, default=64, help="rows per generate call (default 64)")
    s.add_argument("--seed", type=int, default=0, help="of the --samples")
    s.add_argument("--json", metavar="FILE", help="also write every figure and the settings to FILE")
    s.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    s.add_argument("overrides", nargs="*", metavar="key=value",
                   help="data.*, reward.*, task.* and a few rollout keys, e.g. data.prompt_key=question")
    return s
