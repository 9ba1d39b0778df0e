"""The `codraft` command. Each subcommand imports its machinery lazily so `--help` stays instant."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from codraft.cli_bench import bench_commands  # argparse only: --help stays instant
from codraft.errors import CodraftError  # no dependencies: --help stays instant
from codraft.eval.args import add_parser as add_eval_parser  # argparse only: --help stays instant
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
    from codraft.config import load_config, refuse_repeated_keys
    from codraft.rl.interrupt import exit_code, ignore_signals
    from codraft.rl.runs import resume_config
    from codraft.rl.trainer import Trainer
    refuse_repeated_keys(args.overrides)  # steps=3 steps=0: which one was meant?
    if args.resume and args.config:
        raise ValueError(f"--config {args.config} with --resume: a resumed run keeps its own config "
                         f"({args.resume}/config.yaml); only key=value overrides it allows may follow")
    # a resume: the run's config.yaml + resumable overrides (the trainer checks them against the checkpoint)
    cfg = resume_config(args.resume, args.overrides) if args.resume else load_config(args.config, args.overrides)
    trainer = Trainer(cfg, resume=args.resume)
    try:
        trainer.fit()
    except KeyboardInterrupt as e:  # fit checkpointed the last completed step and said where
        ignore_signals()  # exiting: the status stays 128 + the signal whatever arrives now
        trainer.leave()
        if trainer.is_main:
            print(trainer.report())
        sys.exit(exit_code(e))  # 130 after SIGINT, 143 after SIGTERM
    trainer.leave()
    if trainer.is_main:
        print(trainer.report())


def _cmd_generate(args):
    import time

    import torch
    from codraft.bench.spec import CHAT_PROMPTS
    from codraft.policy import load_policy
    from codraft.policy.resolve import policy_config
    from codraft.rl.memory import fit_context
    from codraft.rollout import Engine
    from codraft.tasks import make_task
    from codraft.train.offline_draft import default_task_name, draft_for_command
    _check_generate_args(args)
    gamma = 4 if args.gamma is None else args.gamma
    if args.threads:
        torch.set_num_threads(args.threads)
    config, tok = policy_config(args.model)  # no weights read yet
    context = config.max_position_embeddings
    texts = args.prompt
    if not texts:
        if default_task_name(tok) == "arith":
            texts = [make_task("arith").sample("val", 1, seed=args.seed)[0].prompt]
        else:
            texts = CHAT_PROMPTS[:1]
    # prompt + new tokens past the context: refused (or cut, --truncate-prompt left) before any draft or prefill
    prompts, cut = fit_context([tok.prompt_ids(t) for t in texts], args.max_new_tokens, context,
                               args.truncate_prompt)
    for i, n in cut.items():
        print(f"--truncate-prompt left: prompt {i + 1} cut from {n} to its last {len(prompts[i])} tokens "
              f"(context {context} - --max-new-tokens {args.max_new_tokens})", file=sys.stderr)
    model, tok, folder = load_policy(args.model)
    model.eval()
    draft = None
    if args.draft:
        draft = draft_for_command(args.draft, model, tok, folder, gamma=gamma, init=args.draft_init,
                                  seed=args.seed, progress=not args.json)
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
                         "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                         **({"prompt_truncated_from": cut[i]} if i in cut else {})}
                        for i, (t, p, r) in enumerate(zip(texts, prompts, results))],
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
    from codraft.config import taps_problem
    from codraft.drafts import init_draft
    from codraft.drafts.eagle3_layer import parse_taps
    from codraft.policy import load_policy
    from codraft.tasks import make_task
    from codraft.train.offline_draft import default_task_name, offline_features, train_offline, write_target_record
    _check_train_draft_args(args)
    out = Path(args.out or f"drafts/{args.kind}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file, not a folder")
    model, tok, folder = load_policy(args.model)
    problem = taps_problem(args.taps, args.kind, model.config.num_hidden_layers, key="--taps", kind_key="--kind ")
    if problem:  # the range: the policy's depth is known now
        raise ValueError(problem)
    task = make_task(args.task or default_task_name(tok))
    torch.manual_seed(args.seed)
    draft = init_draft(args.kind, model, gamma=args.gamma, layers=parse_taps(args.taps))
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
    from codraft.config import Taps, taps_problem
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
        ("--taps", args.taps, Taps().allows, str(Taps())),
    ])
    problem = taps_problem(args.taps, args.kind, None, key="--taps", kind_key="--kind ")  # the range: once loaded
    if problem:
        raise ValueError(problem)


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codraft", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    _run_commands(sub)
    bench_commands(sub)
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
    s.add_argument("--truncate-prompt", choices=("left",),
                   help="a prompt that does not fit the context with --max-new-tokens keeps its last tokens "
                        "(default: refused)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    s.set_defaults(fn=_cmd_generate)


def _cmd_export_draft(args):
    from codraft.export.cli import run
    run(args)


def _cmd_eval(args):
    from codraft.eval.command import run
    run(args)


def _tool_commands(sub):
    add_eval_parser(sub).set_defaults(fn=_cmd_eval)
    add_export_parser(sub).set_defaults(fn=_cmd_export_draft)
    s = sub.add_parser("train-draft", help="offline draft training on samples from the target (resumable)")
    s.add_argument("--model", required=True, help="policy name (tiny-sft, smollm2-135m) or HF-format folder")
    s.add_argument("--kind", required=True, help="a draft kind with weights (an unknown kind lists the valid ones)")
    s.add_argument("--out", help="output folder (default drafts/KIND); rerun with the same folder to resume")
    s.add_argument("--task", help="prompt source (default: arith for the tiny model, chain_sum otherwise)")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--gamma", type=int, default=7, help="tokens drafted per round the draft is built for")
    s.add_argument("--taps", default="auto", help="eagle3: the policy layers it taps, e.g. 2,5,8 (three: what the "
                                                  "serving stacks build); auto = the draft's default")
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
    except (CodraftError, ValueError, FileNotFoundError) as e:  # bad input or a deliberate stop: one line, no traceback
        sys.exit(f"codraft {args.cmd}{_which_rank()}: error: {e}")


def run() -> None:
    """The command's entry point (``codraft``, ``python -m codraft``): ``main``, whose error line is written in
    one piece. (The interpreter writes an exit message and its newline separately; under torchrun stderr is
    unbuffered, so two ranks' lines interleaved into one.)"""
    try:
        main()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        sys.stderr.write(e.code + "\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def _which_rank() -> str:
    """Under torchrun every rank prints its own error: say whose it is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '?')} of {world})" if world > 1 else ""


if __name__ == "__main__":
    run()
