"""The `codraft` command. Each subcommand imports its machinery lazily so `--help` stays instant."""
from __future__ import annotations

import argparse
import json
import math
import sys

from codraft.export.args import add_parser as add_export_parser  # argparse only: --help stays instant


def _cmd_sft(args):
    from codraft.policy.warmstart import SFTConfig, warm_start
    cfg = SFTConfig(**({"steps": args.steps} if args.steps else {}), seed=args.seed)
    folder = warm_start(cfg, force=args.force)
    report = json.loads((folder / "sft.json").read_text())
    print(f"tiny policy: {report['parameters'] / 1e6:.2f} M parameters, "
          f"trained {report['train_seconds']:.0f} s, held-out accuracy {report['val_accuracy']:.1%}")
    print(folder)


def _cmd_prepare(args):
    from codraft.models.smollm2 import prepare_smollm2
    if args.name != "smollm2-135m":
        sys.exit(f"codraft prepare: unknown model {args.name!r}; available: smollm2-135m")
    print(prepare_smollm2())


def _cmd_train(args):
    from codraft.config import load_config
    from codraft.rl.runs import resume_config
    from codraft.rl.trainer import Trainer
    if args.resume and args.config:
        raise ValueError(f"--config {args.config} with --resume: a resumed run keeps its own config "
                         f"({args.resume}/config.yaml); only key=value overrides it allows may follow")
    # a resume: the run's config.yaml + resumable overrides (the trainer checks them against the checkpoint)
    cfg = resume_config(args.resume, args.overrides) if args.resume else load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    try:
        trainer.fit()
    except KeyboardInterrupt:  # fit checkpointed the last completed step and said where
        if trainer.is_main:
            print(trainer.report())
        sys.exit(130)
    if trainer.is_main:
        print(trainer.report())


def _cmd_generate(args):
    import time

    import torch
    from codraft.bench.spec import CHAT_PROMPTS
    from codraft.policy import load_policy
    from codraft.rollout import Engine
    from codraft.tasks import make_task
    from codraft.train.offline_draft import default_task_name, draft_for_command
    _check_generate_args(args)
    gamma = 4 if args.gamma is None else args.gamma
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, folder = load_policy(args.model)
    model.eval()
    draft = None
    if args.draft:
        draft = draft_for_command(args.draft, model, tok, folder, gamma=gamma, init=args.draft_init,
                                  seed=args.seed, progress=not args.json)
    texts = args.prompt
    if not texts:
        if default_task_name(tok) == "arith":
            texts = [make_task("arith").sample("val", 1, seed=args.seed)[0].prompt]
        else:
            texts = CHAT_PROMPTS[:1]
    prompts = [tok.prompt_ids(t) for t in texts]
    engine = Engine(model, draft, gamma if draft is not None else None)
    t0 = time.perf_counter()
    results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, eos_id=tok.eos_id)
    wall = time.perf_counter() - t0
    st = engine.stats
    if args.json:
        print(json.dumps({
            "model": args.model, "folder": str(folder), "draft": args.draft, "gamma": engine.gamma or None,
            "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "eos_id": tok.eos_id,
                         "threads": torch.get_num_threads()},
            "results": [{"prompt": t, "prompt_tokens": p, "tokens": r.tokens, "text": tok.decode(r.tokens),
                         "logprobs": r.logprobs, "finish_reason": r.finish_reason}
                        for t, p, r in zip(texts, prompts, results)],
            "stats": {**st.as_dict(), "wall_s": wall}}))
        return
    for i, (t, r) in enumerate(zip(texts, results)):
        print(f"--- [{i}] {t!r} ({len(r.tokens)} tokens, {r.finish_reason})")
        print(tok.decode(r.tokens))
    acc = " ".join(f"{a:.2f}" for a in st.acceptance_per_position) or "-"
    print(f"--- {st.emitted_tokens} tokens in {wall:.2f} s = {st.emitted_tokens / wall:.1f} tok/s"
          + (f"; draft {args.draft} γ={engine.gamma}: τ={st.acceptance_length:.2f}, per-position acceptance [{acc}]"
             if draft is not None else "; plain decoding")
          + f"; time: prefill {st.prefill_s:.2f} s, draft {st.draft_s:.2f} s, verify {st.verify_s:.2f} s, "
            f"bookkeeping {st.bookkeeping_s:.2f} s")


def _cmd_train_draft(args):
    from pathlib import Path

    import torch
    from codraft.drafts import init_draft
    from codraft.policy import load_policy
    from codraft.tasks import make_task
    from codraft.train.offline_draft import default_task_name, offline_features, train_offline, write_target_record
    _check_train_draft_args(args)
    out = Path(args.out or f"drafts/{args.kind}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    model, tok, folder = load_policy(args.model)
    task = make_task(args.task or default_task_name(tok))
    torch.manual_seed(args.seed)
    draft = init_draft(args.kind, model, gamma=args.gamma)
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # topmost new folder
    try:
        features = offline_features(model, tok, task, policy_dir=folder, layers=draft.feature_layers, seed=args.seed,
                                    n_prompts=args.prompts, max_new_tokens=args.max_new_tokens)
        report = train_offline(model, tok, task, draft, out_dir=out, steps=args.steps, lr=args.lr, seed=args.seed,
                               n_prompts=args.prompts, max_new_tokens=args.max_new_tokens, features=features,
                               precision=args.precision)
        write_target_record(out / "draft", model, folder, draft.feature_layers)
    except BaseException:  # an error or Ctrl-C before anything was saved: leave no empty folder behind
        _remove_empty_folders(out, created)
        raise
    print(json.dumps(report))
    print(f"{out}/draft")


def _cmd_plot(args):
    from codraft.rl.plots import PANELS, check_run, plot_compare, plot_run
    for run_dir in args.run_dirs:  # a missing, empty or malformed metrics.jsonl: one line naming it
        check_run(run_dir)
    if len(args.run_dirs) == 1 and not args.out:
        written = plot_run(args.run_dirs[0])
    else:
        written = plot_compare(args.run_dirs, args.out or args.run_dirs[0])
    if not written:
        keys = sorted({k for _, ks, _ in PANELS for k in ks})
        raise ValueError(f"nothing to plot: no metrics.jsonl of {', '.join(args.run_dirs)} has any of "
                         f"{', '.join(keys)}")
    print("\n".join(map(str, written)))


# ---------------------------------------------------------------- command-line values, refused before any work


def _refuse(checks):
    """``checks``: (flag, value, ok, allowed) rows; a value given (not None) that is not ``ok`` is a one-line error."""
    for flag, value, ok, allowed in checks:
        if value is not None and not ok(value):
            raise ValueError(f"{flag} must be {allowed}, got {value!r}")


def _check_generate_args(args):
    _refuse([
        ("--gamma", args.gamma, lambda v: v >= 1, ">= 1 (tokens drafted per round)"),
        ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, ">= 1"),
        ("--temperature", args.temperature, lambda v: math.isfinite(v) and v >= 0, ">= 0 and finite (0 = greedy)"),
        ("--top-p", args.top_p, lambda v: math.isfinite(v) and 0 < v <= 1, "in (0, 1] (1 = off)"),
        ("--top-k", args.top_k, lambda v: v >= 0, ">= 0 (0 = off)"),
        ("--threads", args.threads, lambda v: v >= 1, ">= 1"),
    ])
    if args.gamma is not None and not args.draft:
        raise ValueError(f"--gamma {args.gamma} needs a --draft")
    for i, text in enumerate(args.prompt or []):
        if not text:
            raise ValueError(f"--prompt: prompt {i + 1} is empty; give text to continue (no --prompt: an example)")


def _check_train_draft_args(args):
    from codraft.drafts import available_drafts, draft_kind
    from codraft.tasks import TASKS
    weighted = [k for k in available_drafts() if draft_kind(k).has_weights]
    if args.kind not in available_drafts():
        raise ValueError(f"--kind {args.kind!r} is not a draft kind; kinds with weights to train: "
                         f"{', '.join(weighted)}")
    if args.kind not in weighted:
        raise ValueError(f"--kind {args.kind} has no weights: nothing to train; kinds with weights: "
                         f"{', '.join(weighted)}")
    _refuse([
        ("--steps", args.steps, lambda v: v >= 1, ">= 1"),
        ("--prompts", args.prompts, lambda v: v >= 1, ">= 1 (prompts sampled as training data)"),
        ("--max-new-tokens", args.max_new_tokens, lambda v: v >= 1, ">= 1"),
        ("--gamma", args.gamma, lambda v: v >= 1, ">= 1 (tokens drafted per round)"),
        ("--lr", args.lr, lambda v: math.isfinite(v) and v > 0, "> 0 and finite"),
        ("--task", args.task, lambda v: v in TASKS, f"one of {', '.join(TASKS)}"),
    ])


def _remove_empty_folders(folder, top):
    """Remove ``folder`` and its parents up to ``top`` (the topmost one this command created) while empty."""
    if top is None:
        return
    for p in [folder, *folder.parents]:
        if not p.is_dir() or any(p.iterdir()):
            return
        p.rmdir()
        if p == top:
            return


def _cmd_bench(args):
    if args.bench in ("drift", "parity", "rollout-dtype"):
        from codraft.bench import experiments
        fn = getattr(experiments, args.bench.replace("-", "_"))
        opts = {"steps": args.steps, "extra": args.overrides, "config": args.config}
        if getattr(args, "kinds", None):
            opts["kinds"] = _csv(args.kinds)
        if getattr(args, "dtypes", None):
            opts["dtypes"] = _csv(args.dtypes)
        opts["seeds"] = [int(s) for s in _csv(args.seeds or ("0" if args.bench == "drift" else "0,1,2"))]
        fn(args.out, **opts)
    elif args.bench == "e2e":
        from codraft.bench.e2e import run
        run(steps=args.steps, warmup=args.warmup, draft_kinds=tuple(_csv(args.drafts)), threads=args.threads,
            trl=not args.no_trl, json_path=args.json, max_new_tokens=args.max_new_tokens, prompts=args.prompts,
            group=args.group, gamma=args.gamma, speedup_every=args.speedup_every, interleave=not args.sequential,
            trl_gradient_checkpointing=args.trl_gradient_checkpointing, draft_init=args.draft_init,
            overrides=args.overrides)
    elif args.bench == "cp":
        from codraft.bench.cp import run
        run(lengths=[int(x) for x in _csv(args.lengths)], cps=[int(x) for x in _csv(args.cp)],
            methods=_csv(args.methods), branches=_csv(args.branch), repeats=args.repeats, warmup=args.warmup,
            seed=args.seed, c1_methods=_csv(args.c1_methods), json_path=args.json,
            append=args.append)
    elif args.bench == "tap" and args.step:
        from codraft.bench.tap_step import run
        layers, hidden = (int(x) for x in args.shape.lower().split("x"))
        run(stages=args.stages, shape=(layers, hidden), groups=args.groups, microbatches=args.microbatches or 4,
            methods=_csv(args.methods) if args.methods else ("none", "shm", "p2p", "staging", "relay"),
            repeats=args.repeats, warmup=args.warmup, json_path=args.json)
    elif args.bench == "tap":
        from codraft.bench.tap import parse_size, run
        run(sizes=[parse_size(x) for x in _csv(args.sizes)],
            methods=_csv(args.methods or "shm,p2p,staging,relay"), producers=args.producers,
            taps=args.taps, microbatches=args.microbatches or 8, repeats=args.repeats, warmup=args.warmup,
            json_path=args.json)
    elif args.bench == "gemv":
        from codraft.bench.gemv import run
        run(model_name=args.model, rows=[int(r) for r in _csv(args.rows)], threads=args.threads,
            repeats=args.repeats, dtypes=_csv(args.dtypes), remeasure=args.remeasure, json_path=args.json,
            step_rows=[int(r) for r in _csv(args.step_rows)])
    elif args.bench == "spec":
        from codraft.bench.spec import parse_gammas, run
        run(models=_csv(args.models), batches=[int(b) for b in _csv(args.batches)],
            max_new_tokens=args.max_new_tokens, drafts=_csv(args.drafts), gamma=args.gamma, threads=args.threads,
            repeats=args.repeats, draft_init=args.draft_init, hf=not args.no_hf, json_path=args.json,
            gammas=parse_gammas(args.gammas) if args.gammas else None, dtypes=_csv(args.dtypes),
            t1_rows=args.t1_rows)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codraft", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    _run_commands(sub)
    _bench_commands(sub)
    _tool_commands(sub)
    return p


def _run_commands(sub):

    s = sub.add_parser("train", help="the main job: GRPO with speculative rollouts and a co-trained draft")
    s.add_argument("--config", help="preset name (tiny, smollm2-chainsum) or YAML file; default: tiny")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=3 seed=7")
    s.set_defaults(fn=_cmd_train)

    s = sub.add_parser("sft", help="supervised warm start of the tiny policy on arith (cached)")
    s.add_argument("--steps", type=int)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--force", action="store_true", help="retrain even if cached")
    s.set_defaults(fn=_cmd_sft)

    s = sub.add_parser("prepare", help="build an HF-format folder of a packaged pretrained model")
    s.add_argument("name", help="smollm2-135m")
    s.set_defaults(fn=_cmd_prepare)

    s = sub.add_parser("generate", help="generate text from a policy, plain or with a speculative draft")
    s.add_argument("--model", required=True, help="policy name (tiny-sft, smollm2-135m) or HF-format folder")
    s.add_argument("--draft", help="a draft kind or a saved draft folder (an unknown kind lists the valid ones)")
    s.add_argument("--draft-init", default="offline", choices=("offline", "random"),
                   help="for trained kinds: cached short offline training on the model's task, or untrained")
    s.add_argument("--gamma", type=int, help="tokens drafted per round (default 4)")
    s.add_argument("--prompt", action="extend", nargs="+", metavar="TEXT",
                   help="prompt(s); chat models get their chat template (default: one example prompt)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.set_defaults(fn=_cmd_generate)


def _bench_commands(sub):
    s = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bench = s.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("spec", help="decode tokens/s: plain vs speculative vs transformers generate()")
    b.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2 (default: both)")
    b.add_argument("--batches", default="1,4,16")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--drafts", default="ngram,model", help="comma list of draft kinds or saved draft folders")
    b.add_argument("--draft-init", default="auto", choices=("auto", "offline", "random"),
                   help="trained kinds: auto = offline on tiny, random (untrained) on smollm2")
    b.add_argument("--gamma", type=int, default=4, help="the drafts' γ, the most auto drafts per round")
    b.add_argument("--gammas", help="engine settings to compare per draft, e.g. 2,4,auto (default: --gamma)")
    b.add_argument("--dtypes", default="float32", help="rollout weight dtypes to compare, e.g. float32,bfloat16")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--repeats", type=int, default=3, help="timed repetitions per side (median reported)")
    b.add_argument("--t1-rows", type=int, default=16,
                   help="held-out prompts the temperature-1 (rollout) measure samples per repetition")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    b.add_argument("--json", metavar="FILE", help="write every figure to this JSON file")
    s.set_defaults(fn=_cmd_bench)

    b = bench.add_parser("cp", help="one attention layer fwd+bwd under context parallelism: zigzag vs USP, "
                                     "plain ring, all-gather (gloo, 1 thread per rank)")
    b.add_argument("--lengths", default="8192,16384,32768,65536", help="tokens of the packed row, comma list")
    b.add_argument("--cp", default="1,2,4", help="context-parallel sizes (processes), comma list")
    b.add_argument("--methods", default="zigzag,usp,ring,allgather",
                   help="comma list of zigzag, usp, ring, allgather")
    b.add_argument("--c1-methods", default="single,zigzag",
                   help="rows at C=1: single (the one-process reference) and methods with their own C=1 code")
    b.add_argument("--branch", default="none,eagle3,dflash", help="draft branch shapes: none, eagle3, dflash")
    b.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    b.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    b.add_argument("--seed", type=int, default=0, help="seed of the packings")
    b.add_argument("--json", metavar="FILE")
    b.add_argument("--append", action="store_true",
                   help="merge into an existing --json file (rows measured again replace the old ones)")

    _bench_tap_parser(bench)

    b = bench.add_parser("gemv", help="the measured fast-path table, and few-row products by path: the C "
                                      "kernel, torch's two forms, the chosen one")
    b.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF-format folder")
    b.add_argument("--rows", default=",".join(map(str, range(1, 65))), help="comma list (default 1..64)")
    b.add_argument("--dtypes", default="float32", help="comma list of weight dtypes: float32, bfloat16 "
                                                        "(the weight-only rollout copy)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--repeats", type=int, default=9, help="timed rounds (each side once per round)")
    b.add_argument("--step-rows", default="1,2,4,8,12,16,24,32,40,48,64",
                   help="row counts of whole decode steps timed with each path forced ('' for none)")
    b.add_argument("--remeasure", action="store_true",
                   help="forget the cached dispatch tables ($CODRAFT_CACHE/dispatch) and measure them again")
    b.add_argument("--json", metavar="FILE")

    b = bench.add_parser("e2e", help="full GRPO step (rollout + co-training) vs TRL GRPOTrainer, SmolLM2-135M")
    b.add_argument("--steps", type=int, default=3)
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--drafts", default="none,ngram,dflash", help="comma list: none and draft kinds")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--no-trl", action="store_true", help="time codraft only")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--prompts", type=int, default=2)
    b.add_argument("--group", type=int, default=4)
    b.add_argument("--gamma", type=int, default=4)
    b.add_argument("--speedup-every", type=int, default=0)
    b.add_argument("--draft-init", default="offline", choices=("offline", "random"),
                   help="drafts start from cached offline training (trained on first use) or untrained")
    b.add_argument("--sequential", action="store_true", help="run the sides one after another")
    b.add_argument("--trl-gradient-checkpointing", action="store_true")
    b.add_argument("--json", metavar="FILE")
    b.add_argument("overrides", nargs="*", metavar="key=value", help="extra codraft config overrides")
    _bench_experiment_parsers(bench)


def _bench_experiment_parsers(bench):
    """drift, parity, rollout-dtype: series of train runs (codraft.bench.experiments)."""
    for name, default_steps, help_text in (("drift", 50, "frozen vs co-trained draft τ as the policy drifts"),
                                           ("parity", 30, "reward/accuracy/mismatch with each draft vs none, over seeds"),
                                           ("rollout-dtype", 100, "reward and mismatch KL with bf16 vs fp32 rollout "
                                                                  "weights, over seeds")):
        b = bench.add_parser(name, help=help_text)
        b.add_argument("--out", default=f"runs/{name}", help="folder for the run folders and the summary")
        b.add_argument("--config", help="preset or YAML file the runs start from (default: tiny)")
        b.add_argument("--steps", type=int, default=default_steps)
        if name == "rollout-dtype":
            b.add_argument("--dtypes", help="comma list of rollout.dtype values, the baseline first "
                                            "(default float32,bfloat16)")
        else:
            b.add_argument("--kinds", help="comma list of draft kinds")
        b.add_argument("--seeds", help="comma list of seeds (default: drift 0, the others 0,1,2)")
        b.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")


def _bench_tap_parser(bench):
    b = bench.add_parser("tap", help="TapChannel fan-in of tapped features to the last stage: shared memory vs "
                                      "point-to-point vs host staging vs relay (gloo, 1 thread per process)")
    b.add_argument("--sizes", default="2048x576,2048x128", help="tokens x hidden per feature, comma list")
    b.add_argument("--methods", default="", help="comma list of shm, p2p, staging, relay (default all four); "
                                                  "with --step also none (default all five)")
    b.add_argument("--producers", type=int, default=2, help="producer stages (processes), plus one consumer")
    b.add_argument("--taps", type=int, default=3, help="tapped layers, spread over the producers")
    b.add_argument("--microbatches", type=int, default=0, help="micro-batches per bandwidth round (default 8); "
                                                                "with --step: per PP step (default 4)")
    b.add_argument("--step", action="store_true", help="the taps' cost in a PP co-training step instead: draft "
                                                       "off vs each transport (codraft.bench.tap_step)")
    b.add_argument("--stages", type=int, default=2, help="--step: pipeline stages (processes)")
    b.add_argument("--shape", default="4x128", help="--step: the policy's layers x hidden")
    b.add_argument("--groups", type=int, default=8, help="--step: prompts (x 4 completions) per step")
    b.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    b.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    b.add_argument("--json", metavar="FILE")


def _cmd_export_draft(args):
    from codraft.export.cli import run
    run(args)


def _tool_commands(sub):
    add_export_parser(sub).set_defaults(fn=_cmd_export_draft)
    s = sub.add_parser("train-draft", help="offline draft training on samples from the target (resumable)")
    s.add_argument("--model", required=True, help="policy name (tiny-sft, smollm2-135m) or HF-format folder")
    s.add_argument("--kind", required=True, help="a draft kind with weights (an unknown kind lists the valid ones)")
    s.add_argument("--out", help="output folder (default drafts/KIND); rerun with the same folder to resume")
    s.add_argument("--task", help="prompt source (default: arith for the tiny model, chain_sum otherwise)")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--gamma", type=int, default=7, help="tokens drafted per round the draft is built for")
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--prompts", type=int, default=512, help="prompts sampled from the target as training data")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--precision", choices=("float32", "bfloat16", "auto"), default="float32",
                   help="the draft's products: fp32, bf16 (matrix products only), or auto (timed once on this machine)")
    s.set_defaults(fn=_cmd_train_draft)

    s = sub.add_parser("plot", help="PNG plots of a run folder, or overlays of several")
    s.add_argument("run_dirs", nargs="+")
    s.add_argument("--out", help="folder for overlay plots (default: the first run folder)")
    s.set_defaults(fn=_cmd_plot)



def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        sys.exit(f"codraft {args.cmd}: error: {e}")


if __name__ == "__main__":
    main()
