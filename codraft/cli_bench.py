"""`codraft bench ...`: the benchmark subcommands' parsers and their dispatch. Each benchmark imports its
machinery (codraft.bench.<name>) lazily, as the rest of the command does, so `--help` stays instant."""
from __future__ import annotations


def bench_commands(sub):
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
    _bench_dp_parser(bench)
    _bench_tp_parser(bench)

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
    _bench_measure_parsers(bench)
    _bench_rollout_parser(bench)


def _bench_measure_parsers(bench):
    """draft-length, precision, first-timing: one measured question each (codraft.bench.<name>)."""
    b = bench.add_parser("draft-length", help="gamma=auto: each round's measured ms next to what the draft-length "
                                              "cost model predicts, per live rows and chosen g")
    b.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF-format folder")
    b.add_argument("--draft", default="dspark", help="a draft kind or a saved draft folder")
    b.add_argument("--draft-init", default="offline", choices=("offline", "random"))
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="rollout weights (rollout.dtype)")
    b.add_argument("--batch", type=int, default=8, help="prompts per rollout call")
    b.add_argument("--prompts", type=int, default=16, help="held-out prompts per repetition")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--json", metavar="FILE")

    b = bench.add_parser("precision", help="training steps with fp32 vs bf16 products: the GRPO loss (policy, "
                                           "draft) and offline draft steps, interleaved")
    b.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF-format folder")
    b.add_argument("--parts", default="grpo,offline", help="comma list of grpo, offline")
    b.add_argument("--drafts", default="dspark", help="grpo: draft kinds co-trained in the loss")
    b.add_argument("--offline-drafts", default="dspark,dflash", help="offline: draft kinds whose offline step is timed")
    b.add_argument("--draft-init", default="offline", choices=("offline", "random"),
                   help="grpo: the drafts start as the preset's (cached offline training) or untrained")
    b.add_argument("--prompts", type=int, default=2, help="grpo: prompts of the rollout batch")
    b.add_argument("--group", type=int, default=8, help="grpo: completions per prompt")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--sequences", type=int, help="offline: sequences of the feature cache (default: the recipe's)")
    b.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    b.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--json", metavar="FILE")

    b = bench.add_parser("first-timing", help="seconds and peak memory of timing a model's dispatch tables "
                                              "from nothing (a private folder: the cached ones stay)")
    b.add_argument("--model", default="smollm2", help="tiny, smollm2 or an HF-format folder")
    b.add_argument("--dtypes", default="float32", help="comma list of weight dtypes: float32, bfloat16")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--json", metavar="FILE")


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


def _bench_dp_parser(bench):
    b = bench.add_parser("multiturn", help="multi-turn tool calling: the end-to-end gain of speculative rollouts "
                                            "as tool latency grows (env.latency_ms)")
    b.add_argument("--config", default="tiny-tools", help="a preset or YAML with an environment (env.name)")
    b.add_argument("--latency-ms", default="0,20,100", help="comma list of env.latency_ms values")
    b.add_argument("--steps", type=int, default=4, help="timed trainer steps per latency after one warm-up (median)")
    b.add_argument("--json", metavar="FILE")
    b.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")

    b = bench.add_parser("moe", help="the verify forward of γ + 1 tokens against one token, for a MoE target and a "
                                      "dense one of the same active size; experts activated")
    b.add_argument("--hidden", type=int, default=512)
    b.add_argument("--layers", type=int, default=8)
    b.add_argument("--experts", type=int, default=16)
    b.add_argument("--top-k", type=int, default=2)
    b.add_argument("--moe-size", type=int, default=512, help="an expert's intermediate size (dense: top-k times it)")
    b.add_argument("--gammas", default="1,3,7")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--context", type=int, default=128)
    b.add_argument("--repeats", type=int, default=20)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--json", metavar="FILE")

    b = bench.add_parser("dp", help="data parallelism at dp=1 vs dp=2 and dp=2 × pp=2 (gloo, 1 thread per rank): "
                                     "per-rank bytes of parameters, gradients and AdamW state (fsdp, ddp), the "
                                     "refit, a trainer step")
    b.add_argument("--model", default="smollm2", help="memory and refit parts: tiny, smollm2 or an HF-format folder")
    b.add_argument("--parts", default="memory,refit,step,stages",
                   help="comma list of memory, refit, step, stages (dp=2 × pp=2: bytes and weight sync, 4 processes)")
    b.add_argument("--repeats", type=int, default=5, help="refit: timed calls (median reported)")
    b.add_argument("--steps", type=int, default=3, help="step: timed trainer steps after one warm-up (median)")
    b.add_argument("--prompts", type=int, default=8,
                   help="step: rollout.prompts_per_step at dp=1 (dp=2 runs twice as many: weak scaling)")
    b.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    b.add_argument("--json", metavar="FILE")
    b.add_argument("overrides", nargs="*", metavar="key=value",
                   help="step: config overrides of the tiny preset, both sides (e.g. parallel.dp_shard=ddp)")


def _bench_tp_parser(bench):
    b = bench.add_parser("tp", help="tensor parallelism at tp=1 vs tp=2 and dp=2 × tp=2 (gloo, 1 thread per rank): "
                                     "per-rank bytes of parameters, gradients and AdamW state, a forward + backward, "
                                     "a trainer step")
    b.add_argument("--model", default="tiny", help="memory part: tiny, smollm2 or an HF-format folder (its heads, KV "
                                                    "heads and MLP must divide by --tp)")
    b.add_argument("--parts", default="memory,step", help="comma list of memory, step")
    b.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks compared with one process")
    b.add_argument("--tokens", type=int, default=256, help="memory: tokens of the packed row (4 sequences)")
    b.add_argument("--repeats", type=int, default=3, help="memory: timed forward + backward calls (median reported)")
    b.add_argument("--steps", type=int, default=3, help="step: timed trainer steps after one warm-up (median)")
    b.add_argument("--prompts", type=int, default=8, help="step: rollout.prompts_per_step, both sides (strong scaling)")
    b.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    b.add_argument("--json", metavar="FILE")
    b.add_argument("overrides", nargs="*", metavar="key=value", help="step: config overrides of the tiny preset, "
                                                                      "both sides")


def _bench_rollout_parser(bench):
    b = bench.add_parser("rollout", help="rollouts through codraft's engine vs vLLM (rollout.backend), plain and "
                                          "speculative: tokens/s, τ, the refit, peak memory")
    b.add_argument("--backends", default="codraft,vllm", help="comma list of codraft (the baseline) and vllm")
    b.add_argument("--policy", default="tiny-sft", help="tiny-sft, smollm2-135m or an HF-format folder")
    b.add_argument("--draft", default="offline", help="the EAGLE-3 draft: offline (cached offline training, built "
                                                      "on first use), random (untrained) or a saved draft's folder")
    b.add_argument("--batches", default="1,8", help="prompts per call, comma list")
    b.add_argument("--max-new-tokens", type=int, default=64, help="tokens a row decodes (EOS off)")
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--greedy", action="store_true", help="temperature 0 (and the spec = plain token check)")
    b.add_argument("--gamma", type=int, default=4, help="tokens drafted per round")
    b.add_argument("--repeats", type=int, default=3, help="timed calls per row after a warm-up (median reported)")
    b.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="rollout weights (rollout.dtype), both backends")
    b.add_argument("--kv-cache-gb", type=int, default=1, help="vLLM's KV cache per engine (rollout.vllm_kv_cache_gb)")
    b.add_argument("--json", metavar="FILE")


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


def _cmd_bench(args):
    from codraft.config import refuse_repeated_keys
    refuse_repeated_keys(getattr(args, "overrides", []))  # what the runs add comes before them, and yields
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
    elif args.bench == "multiturn":
        from codraft.bench.multiturn import run
        run(config=args.config, latencies=[float(x) for x in _csv(args.latency_ms)], steps=args.steps,
            overrides=args.overrides, json_path=args.json)
    elif args.bench == "moe":
        from codraft.bench.moe import run
        run(hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k, moe_size=args.moe_size,
            gammas=[int(x) for x in _csv(args.gammas)], batch=args.batch, context=args.context, repeats=args.repeats,
            threads=args.threads, json_path=args.json)
    elif args.bench == "dp":
        from codraft.bench.dp import run
        run(model_name=args.model, parts=_csv(args.parts), repeats=args.repeats, steps=args.steps,
            prompts=args.prompts, threads=args.threads, overrides=args.overrides, json_path=args.json)
    elif args.bench == "tp":
        from codraft.bench.tp import run
        run(model_name=args.model, parts=_csv(args.parts), tp=args.tp, tokens=args.tokens, repeats=args.repeats,
            steps=args.steps, prompts=args.prompts, threads=args.threads, overrides=args.overrides,
            json_path=args.json)
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
    elif args.bench == "rollout":
        from codraft.bench.rollout import run
        run(backends=_csv(args.backends), policy=args.policy, draft=args.draft,
            batches=[int(b) for b in _csv(args.batches)], max_new_tokens=args.max_new_tokens,
            temperature=0.0 if args.greedy else args.temperature, gamma=args.gamma, repeats=args.repeats,
            dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, json_path=args.json)
    elif args.bench == "draft-length":
        from codraft.bench.draft_length import run
        run(model_name=args.model, draft=args.draft, draft_init=args.draft_init, dtype=args.dtype, batch=args.batch,
            prompts=args.prompts, repeats=args.repeats, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, threads=args.threads, json_path=args.json)
    elif args.bench == "precision":
        from codraft.bench.precision import run
        run(model_name=args.model, parts=_csv(args.parts), drafts=_csv(args.drafts),
            offline_kinds=_csv(args.offline_drafts),
            draft_init=args.draft_init, prompts=args.prompts, group=args.group, max_new_tokens=args.max_new_tokens,
            sequences=args.sequences, rounds=args.rounds, warmup=args.warmup, threads=args.threads,
            json_path=args.json)
    elif args.bench == "first-timing":
        from codraft.bench.first_timing import run
        run(model_name=args.model, dtypes=_csv(args.dtypes), threads=args.threads, json_path=args.json)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]
