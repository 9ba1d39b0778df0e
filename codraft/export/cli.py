"""Running ``codraft export-draft`` (arguments: args.py): ``run(args)`` exports and prints where the
folder went, the taps in each counting, what a stack does differently (notes) and the serving
commands (docs/serving.md). Also runnable alone: ``python -m codraft.export.cli DRAFT_DIR --out DIR ...``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from codraft.errors import CodraftError
from codraft.export.args import add_parser
from codraft.export.layout import STACK_NAMES
from codraft.export.write import Exported, export_draft


def run(args) -> None:
    e = export_draft(args.source, args.out, target=args.target, dtype=args.dtype, force=args.force,
                     mask_token_id=args.mask_token_id, stack=args.stack)
    print(f"exported the {e.kind} draft of {e.origin} to {e.path} ({e.dtype})")
    print(f"loads in: {', '.join(STACK_NAMES[s] for s in e.stacks)} (architecture {e.architecture})")
    print(f"taps: the outputs of target layers {e.taps['layer_output']} (as the configs of SpecForge, DeepSpec and "
          f"SGLang count them), captured by vLLM and SGLang as the inputs of layers {e.taps['vllm_layer_input']}")
    for note in e.notes:
        print(f"note: {note}")
    commands = serve_commands(e)
    if commands:
        print("serve with:")
    elif e.stack == "specforge":
        print("no serving command: --stack specforge (SpecForge continues training from the folder)")
    else:
        print("no serving command: neither vLLM nor SGLang loads this folder as written (see the notes)")
    for line in commands:
        print(f"  {line}")


def serve_commands(e: Exported) -> list[str]:
    """The vLLM and SGLang command lines for the exported folder next to its policy (docs/serving.md), for
    the stacks that load it (and were asked for with --stack)."""
    target, draft = shlex.quote(str(e.target_dir)), shlex.quote(str(e.path))
    spec = json.dumps({"method": e.kind, "model": str(e.path), "num_speculative_tokens": e.gamma})
    vllm = f"vllm serve {target} --dtype bfloat16 --speculative-config {shlex.quote(spec)}"
    sglang = f"python -m sglang.launch_server --model-path {target} --dtype bfloat16 --speculative-draft-model-path {draft}"
    if e.kind == "eagle3":
        sglang += (f" --speculative-algorithm EAGLE3 --speculative-num-steps {e.gamma} --speculative-eagle-topk 1"
                   f" --speculative-num-draft-tokens {e.gamma + 1}")
    elif e.kind == "dflash":
        sglang += " --speculative-algorithm DFLASH"
    else:
        sglang += f" --speculative-algorithm DSPARK --speculative-num-draft-tokens {e.gamma + 1}"
    wanted = [s for s in e.stacks if e.stack in ("all", s)]
    return [line for s, line in (("vllm", vllm), ("sglang", sglang)) if s in wanted]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="codraft")
    add_parser(p.add_subparsers(dest="cmd", required=True)).set_defaults(fn=run)
    args = p.parse_args(["export-draft", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.fn(args)
    except (CodraftError, ValueError, FileNotFoundError) as e:  # bad input: one clear line, as `codraft` does
        sys.exit(f"codraft export-draft: error: {e}")


if __name__ == "__main__":
    main()
