"""``codraft eval``: check the options, open what to evaluate (``source``), run ``evaluate`` over it with a
batched, progress-barred engine, print the table and write the JSON."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from codraft.atomic import atomic_write_text
from codraft.eval.evaluate import batched, evaluate
from codraft.eval.passk import default_ks
from codraft.eval.report import as_json, table
from codraft.eval.source import open_target
from codraft.rewards import parse_funcs, parse_weights
from codraft.rollout import Engine


def check(args) -> list[int]:
    """Every option's value, before anything loads -> the k of pass@k."""
    bad = [("--limit", args.limit, lambda v: v >= 1, ">= 1"),
           ("--samples", args.samples, lambda v: v >= 0, ">= 0 (0: greedy only)"),
           ("--temperature", args.temperature, lambda v: math.isfinite(v) and v > 0, "> 0 and finite (the greedy "
                                                                                     "pass is temperature 0)"),
           ("--threshold", args.threshold, math.isfinite, "finite"),
           ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, ">= 1"),
           ("--batch-size", args.batch_size, lambda v: v >= 1, ">= 1"),
           ("--gamma", args.gamma, lambda v: v == "auto" or (v.isdigit() and int(v) >= 1), "an int >= 1 or auto")]
    for flag, value, ok, allowed in bad:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {allowed}, got {value!r}")
    if args.data is not None and args.task is not None:
        raise ValueError(f"--data {args.data} and --task {args.task}: give one source of prompts")
    if args.gamma is not None and args.draft == "none":
        raise ValueError(f"--gamma {args.gamma} with --draft none: plain decoding drafts nothing")
    if args.json is not None and (Path(args.json).is_dir() or not Path(args.json).parent.is_dir()):
        raise ValueError(f"--json {args.json}: not a file in an existing folder")
    if not args.greedy and not args.samples:
        raise ValueError("--no-greedy without --samples: nothing to evaluate")
    if args.k is None:
        return default_ks(args.samples) if args.samples else []
    if not args.samples:
        raise ValueError(f"--k {args.k} needs --samples n (n samples per prompt)")
    try:
        ks = sorted({int(k) for k in args.k.split(",")})
    except ValueError:
        raise ValueError(f"--k must be comma-separated integers, got {args.k!r}") from None
    if ks[0] < 1 or ks[-1] > args.samples:
        raise ValueError(f"--k must be in 1..--samples ({args.samples}), got {args.k!r}")
    return ks


def run(args) -> dict:
    ks = check(args)
    t = open_target(args.model, data=args.data, task=args.task, reward=args.reward, overrides=args.overrides,
                    max_new_tokens=args.max_new_tokens, limit=args.limit, draft=args.draft, gamma=args.gamma,
                    draft_init=args.draft_init, progress=args.progress, trust_run_rewards=args.trust_run_rewards)
    engine = Engine(t.policy, t.draft, t.gamma)
    r = t.cfg.rollout
    decode = batched(engine, r.max_new_tokens, eos_id=t.tok.eos_id, top_p=r.top_p, batch=args.batch_size,
                     progress=args.progress)
    try:
        ev = evaluate(decode, t.problems, t.prompts, t.rewards, t.tok, do_greedy=args.greedy, samples=args.samples,
                      temperature=args.temperature, seed=args.seed, ks=ks, threshold=args.threshold)
    finally:
        t.rewards.close()  # (your functions' worker process)
    speculative = t.draft is not None
    head = {"model": args.model, "origin": t.origin, "draft": t.draft_label, "gamma": t.gamma,
            "settings": {"data": t.data, "prompts": len(t.problems),
                         "reward_funcs": parse_funcs(t.cfg.reward.funcs) or [t.cfg.task.name],
                         "reward_weights": parse_weights(t.cfg.reward.weights) or None,
                         "max_new_tokens": r.max_new_tokens, "top_p": r.top_p, "samples": args.samples,
                         "temperature": args.temperature if args.samples else None, "seed": args.seed, "ks": ks,
                         "threshold": args.threshold, "batch_size": args.batch_size, "device": t.cfg.device,
                         "dtype": t.cfg.policy.dtype, "rollout_dtype": r.dtype}}
    result = as_json(ev, speculative, head)
    s = result["settings"]
    plain = "plain decoding" if not speculative else f"draft: {t.draft_label}, γ={t.gamma}"
    print(f"{t.origin}; {plain}\n{s['data']}: {s['prompts']} prompts; reward {', '.join(s['reward_funcs'])}; "
          f"at most {s['max_new_tokens']} new tokens\n")
    print(table(result, args.temperature))
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
        print(f"\n{args.json}", file=sys.stderr)
    return result
