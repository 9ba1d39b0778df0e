"""`codraft bench spec`: decode throughput, plain vs speculative, next to `transformers` in the same run.

For each model (``tiny`` = the tiny-sft char model on arith prompts, ``smollm2`` =
SmolLM2-135M-Instruct fp32 on a fixed list of 16 chat instructions) and batch size B, on
the first B prompts, timed sides:

  codraft plain      ``Engine(model)``, greedy
  codraft spec/<d>   ``Engine(model, draft, gamma)``, greedy, for each draft d (ngram, model, ...);
                     with several ``gammas`` (ints, or "auto": 0..gamma per round, sized to the
                     live batch by a cost model calibrated once up front), one side per value,
                     ``codraft spec/<d> γ=<g>``, whose rows carry the histogram of drafts per round
  hf generate        ``transformers`` ``generate()`` greedy on an HF model built from the same folder
  hf prompt-lookup   ``generate(prompt_lookup_num_tokens=10)`` (transformers supports it at B=1 only)

With ``dtypes`` (e.g. float32,bfloat16) the codraft sides run once per rollout dtype: bfloat16 decodes
the weight-only bf16 copy the trainer's ``rollout.dtype=bfloat16`` uses (``codraft.rollout.weights``),
sides named ``... bf16``; every row carries its ``dtype``, and a side's "vs plain" and
``identical_to_plain`` compare with the plain side of its own dtype.

Throughput is compared under greedy decoding with EOS disabled on every side, so every row
of every side produces exactly ``max_new_tokens`` tokens and the work is identical; greedy
tokens of codraft plain vs HF are compared too (``match_hf``). Acceptance length τ is also
measured at temperature 1 (EOS on, seeded) for every draft: the RL setting. Sampled lengths vary a
lot, so that measure covers ``t1_rows`` held-out prompts per repetition (B per call, the same
prompts and seeds on every side): its tokens/s and τ are pooled over all of them.

Timing: one warm-up run per side, then ``repeats`` rounds in which the sides run
interleaved (so load from other processes spreads evenly over them): each greedy call, and each
T = 1 call of a round, by every side in turn; the median is reported. tokens/s = new tokens of
all rows / wall time of the whole call (prefill included).
The memory-bandwidth bound of one decode step (``codraft.bench.bandwidth``) is shown next
to codraft's and HF's plain decode time per step at batch 1.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Callable

import torch

from codraft.bench import CpuMeter, format_table, machine_info, median, write_json
from codraft.bench.bandwidth import decode_bound_s, measure_bandwidth, weight_bytes
from codraft.policy import load_policy
from codraft.rollout import Engine, load_or_calibrate
from codraft.rollout.stats import SpecStats
from codraft.rollout.weights import RolloutWeights
from codraft.tasks import make_task
from codraft.train.offline_draft import default_task_name, draft_for_command

MODELS = {"tiny": "tiny-sft", "smollm2": "smollm2-135m"}
DEFAULT_DRAFTS = ("ngram", "model")

# Diverse single-turn instructions for the chat model (no dataset needed): the same list,
# in this order, for every side and batch size (batch B uses the first B).
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.",
    "List five tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Write a polite email asking a colleague to review my report.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a simple tomato pasta sauce?",
    "Why is the sky blue?",
    "Give me three ideas for a birthday party for a ten-year-old.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Write a haiku about the ocean.",
    "What are the main causes of climate change?",
    "Explain what a prime number is and give some examples.",
    "Describe the water cycle step by step.",
    "Write a Python function that reverses a string.",
    "What should I pack for a weekend hiking trip?",
]


# ---------------------------------------------------------------- sides


@dataclass
class Side:
    name: str
    run: Callable[[list[list[int]]], dict]  # prompts -> {"tokens": [[...]], optional "stats"}
    times: list[float] = field(default_factory=list)
    last: dict = field(default_factory=dict)
    sampled: bool = False  # also timed as a rollout: temperature 1, EOS on (codraft's sides)
    dtype: str = "float32"  # of the weights it decodes with
    times_t1: list[float] = field(default_factory=list)
    tokens_t1: list[int] = field(default_factory=list)
    stats_t1: list[dict] = field(default_factory=list)


def parse_gammas(text: str) -> list[int | str]:
    """ "2,4,auto" -> [2, 4, "auto"]; each an int >= 1 or auto."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item != "auto" and not (item.isdigit() and int(item) >= 1):
            raise ValueError(f"--gammas: {item!r} is not an int >= 1 or auto")
        out.append(item if item == "auto" else int(item))
    if not out:
        raise ValueError("--gammas is empty; give e.g. 2,4,auto")
    return out


def _codraft_side(name, model, draft, gamma, max_new, cost_model=None, dtype="float32"):
    engine = Engine(model, draft, gamma if draft is not None else None, cost_model=cost_model)

    def run(prompts, n=max_new, temperature=0.0, eos=(), seed=0):
        res = engine.generate(prompts, n, temperature=temperature, eos_id=list(eos), seed=seed)
        return {"tokens": [r.tokens for r in res], "stats": engine.stats.as_dict()}

    return Side(name, run, sampled=True, dtype=dtype)


def _hf_side(name, hf, pad_id, max_new, lookup: int | None = None):
    from transformers import GenerationConfig

    def run(prompts, n=max_new):
        t = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (t - len(p)) + p for p in prompts])  # left padding, as HF expects
        mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=pad_id,
                               bos_token_id=None, prompt_lookup_num_tokens=lookup)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=cfg)
        if out.shape[1] - t != n:  # tokens per second over fewer tokens would be mostly prefill
            raise RuntimeError(f"{name}: HF generated {out.shape[1] - t} tokens, not {n}")
        return {"tokens": out[:, t:].tolist()}

    return Side(name, run)


def _load_hf(folder):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # generate() fills a setting left None from the model's own generation config: its EOS would
    # stop the greedy rows (SmolLM2's after 13 of 128 tokens) that codraft decodes with EOS off
    hf.generation_config.eos_token_id = None
    return hf


def _prompts(tok, n: int) -> list[list[int]]:
    """Held-out prompts of the task the model's offline drafts train on (arith / chain_sum, val split)."""
    return [tok.prompt_ids(p.prompt) for p in make_task(default_task_name(tok)).sample("val", n, seed=0)]


def _match(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each row's tokens that agree before the first difference."""
    fr = []
    for x, y in zip(a, b):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        fr.append(k / max(len(x), 1))
    return sum(fr) / len(fr)


# ---------------------------------------------------------------- the benchmark


def bench_model(model_name: str, *, batches, max_new: int, drafts, gamma: int, repeats: int, draft_init: str,
                hf: bool = True, gammas=None, dtypes=("float32",), t1_rows: int = 16, log=print) -> dict:
    init = MODELS.get(model_name, model_name)
    policy, tok, folder = load_policy(init)
    policy.eval()
    nbytes = weight_bytes(policy)
    out = {"policy": init, "folder": str(folder), "parameters": sum(p.numel() for p in policy.parameters()),
           "weight_bytes": nbytes, "drafts": {}, "rows": []}
    built = {}
    for spec in drafts:
        d_init = draft_init if draft_init != "auto" else ("offline" if default_task_name(tok) == "arith" else "random")
        t0 = perf_counter()
        try:
            # a first offline training takes minutes (feature cache, then the draft): its bars go to stderr
            draft = draft_for_command(spec, policy, tok, folder, gamma=gamma, init=d_init)
        except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
            log(f"  draft {spec}: skipped ({type(e).__name__}: {e})")
            out["drafts"][spec] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out["drafts"][spec] = {"init": "-" if spec == "ngram" else d_init, "build_s": perf_counter() - t0,
                               "weight_bytes": weight_bytes(draft) if isinstance(draft, torch.nn.Module) else 0}
        built[spec] = draft
    sides = []
    for dtype in dtypes:
        sides += _codraft_sides(policy, built, dtype, gammas or [gamma], bool(gammas), max_new, max(batches), out)
    hf_model = None
    if hf:
        hf_model = _load_hf(folder)
        sides.append(_hf_side("hf generate", hf_model, tok.pad_id, max_new))
        pld = _hf_side("hf prompt-lookup", hf_model, tok.pad_id, max_new, lookup=10)
    all_prompts = _prompts(tok, max(*batches, t1_rows))
    for b in batches:
        prompts = all_prompts[:b]
        # the rollout measure: t1_rows distinct prompts per repetition, b at a time; lengths at T = 1 vary
        # a lot, so one call of b rows is too few tokens for a ratio
        t1_calls = [all_prompts[i:i + b] for i in range(0, max(t1_rows, b), b)]
        these = sides + ([pld] if hf and b == 1 else [])
        sampled = [s for s in these if s.sampled]
        for s in these:
            s.times, s.times_t1, s.tokens_t1, s.stats_t1 = [], [], [], []
            s.run(prompts, n=min(max_new, 16))  # warm-up: allocator, thread pool, kernels
        meter = CpuMeter()
        for rep in range(repeats):
            for s in these:
                t = perf_counter()
                s.last = s.run(prompts)
                s.times.append(perf_counter() - t)
            # as rollouts sample (T = 1, EOS on), each call by every side in turn: a call takes ~1-5 s, so a
            # change in the host's speed reaches every side alike
            for i, call in enumerate(t1_calls):
                for s in sampled:
                    t = perf_counter()
                    r = s.run(call, temperature=1.0, eos=[tok.eos_id], seed=1 + rep * len(t1_calls) + i)
                    s.times_t1.append(perf_counter() - t)
                    s.tokens_t1.append(sum(map(len, r["tokens"])))
                    s.stats_t1.append(r["stats"])
        load = meter.read()
        ref = next((s.last["tokens"] for s in these if s.name == "hf generate"), None)
        plains = {s.dtype: s for s in these if s.name.startswith("codraft plain")}
        out["rows"] += [_row(s, plains[s.dtype], b, max_new, load, ref) for s in these]
        log(f"  {model_name} batch {b}: done ({load.get('others_cores', float('nan')):.2f} cores busy elsewhere, "
            f"{load.get('stolen_cores', float('nan')):.2f} stolen by the hypervisor)")
    return out


def _row(s: Side, plain: Side, b: int, max_new: int, load: dict, ref) -> dict:
    """One side's figures at batch b; ``plain``: the plain side of its dtype (hf's are float32), ``ref``:
    HF's greedy tokens, or None."""
    n_tok = sum(map(len, s.last["tokens"]))
    row = {"batch": b, "side": s.name, "dtype": s.dtype, "new_tokens": n_tok, "seconds": s.times,
           "tokens_per_s": n_tok / median(s.times), "others_cores": load.get("others_cores"),
           "stolen_cores": load.get("stolen_cores")}
    if n_tok != b * max_new:
        row["warning"] = f"{n_tok} tokens instead of {b * max_new}"
    st = s.last.get("stats")
    if st is not None:
        row["stats_greedy"] = st
        row["tau_greedy"] = st["acceptance_length"]
        row["gamma_chosen"] = st["gamma_chosen"]  # rounds that drafted 0, 1, … tokens
        # target forward + sampling/accept per round: a plain decode step, or one γ+1-token verify
        row["ms_per_forward"] = _ms_per_round(st, "verify_s")
    if s.sampled:  # tokens over time summed over the repetitions: their lengths differ
        row["seconds_t1"] = s.times_t1
        row["tokens_per_s_t1"] = sum(s.tokens_t1) / sum(s.times_t1)
        row["speedup_t1"] = row["tokens_per_s_t1"] / (sum(plain.tokens_t1) / sum(plain.times_t1))
    if s.name.startswith("codraft spec/"):
        row["identical_to_plain"] = s.last["tokens"] == plain.last["tokens"]
        t1 = _pooled(s.stats_t1)
        row["stats_t1"] = t1
        row["tau_t1"] = t1["acceptance_length"]
        row["acceptance_per_position_t1"] = t1["acceptance_per_position"]
        row["gamma_chosen_t1"] = t1["gamma_chosen"]
        # a round's cost split: the target's verify (or plain step) and the draft's propose + commit
        row["verify_ms_per_round_t1"] = _ms_per_round(t1, "verify_s")
        row["draft_ms_per_round_t1"] = _ms_per_round(t1, "draft_s")
    if ref is not None and s is plain and s.dtype == "float32":
        row["match_hf"] = _match(plain.last["tokens"], ref)
    return row


def _ms_per_round(stats: dict, phase: str) -> float:
    """An engine phase's time (``verify_s``, ``draft_s``) per round, in ms."""
    return 1e3 * stats[phase] / max(stats["rounds"], 1)


_TAGS = {"float32": "", "bfloat16": " bf16"}


def _codraft_sides(policy, drafts: dict, dtype: str, gammas: list, named_gammas: bool, max_new: int, rows: int,
                   out: dict) -> list[Side]:
    """The codraft sides of one rollout dtype: plain, then each draft at each γ, decoding the rollout copy
    of that dtype (the policy itself for float32); records its weight bytes and whether they sit in huge
    pages in ``out``."""
    weights, tag = RolloutWeights(policy, getattr(torch, dtype)), _TAGS[dtype]
    target = weights.policy
    out.setdefault("weight_bytes_by_dtype", {})[dtype] = weight_bytes(target)
    out.setdefault("huge_pages_by_dtype", {})[dtype] = weights.huge_pages
    sides = [_codraft_side("codraft plain" + tag, target, None, None, max_new, dtype=dtype)]
    for spec, draft in drafts.items():
        draft = weights.draft_for(draft)
        for g in gammas:
            cost = load_or_calibrate(target, draft, draft.default_gamma, rows) if g == "auto" else None
            sides.append(_codraft_side(f"codraft spec/{spec}" + (f" γ={g}" if named_gammas else "") + tag, target,
                                       draft, g, max_new, cost, dtype))
    return sides


def _pooled(stats: list[dict]) -> dict:
    """The T = 1 statistics of all repetitions as one: counts and times summed, rates recomputed."""
    names = [f.name for f in dataclasses.fields(SpecStats)]
    return SpecStats.pool([SpecStats(**{n: st[n] for n in names}) for st in stats]).as_dict()


def summarize(result: dict) -> list[dict]:
    """Per model: plain decode ms/token at batch 1 vs the bandwidth bound and vs HF."""
    # the best bandwidth seen (before and after the runs): a lower floor, never an inflated one
    bw_GBps = max(b[k] for b in (result["bandwidth"], result.get("bandwidth_after") or {})
                  for k in ("copy_GBps", "read_GBps") if k in b)
    out = []
    for name, m in result["models"].items():
        hf = next((r for r in m["rows"] if r["batch"] == 1 and r["side"] == "hf generate"), None)
        fp32 = None
        for plain in (r for r in m["rows"] if r["batch"] == 1 and r["side"].startswith("codraft plain")):
            nbytes = m.get("weight_bytes_by_dtype", {}).get(plain["dtype"], m["weight_bytes"])
            bound = decode_bound_s(nbytes, bw_GBps) * 1e3
            s = {"model": name, "dtype": plain["dtype"], "weight_MB": nbytes / 1e6, "bandwidth_GBps": bw_GBps,
                 "bound_ms": bound, "codraft_ms_per_token": 1e3 / plain["tokens_per_s"],
                 "codraft_ms_per_step": plain.get("ms_per_forward")}
            s["codraft_vs_bound"] = s["codraft_ms_per_token"] / bound
            if hf is not None:
                s["hf_ms_per_token"] = 1e3 / hf["tokens_per_s"]
                s["hf_vs_bound"] = s["hf_ms_per_token"] / bound
                s["codraft_speedup_vs_hf"] = plain["tokens_per_s"] / hf["tokens_per_s"]
            fp32 = plain if plain["dtype"] == "float32" else fp32
            if fp32 is not None and plain is not fp32:
                s["speedup_vs_float32"] = plain["tokens_per_s"] / fp32["tokens_per_s"]
            out.append(s)
    return out


def _label(name: str) -> str:
    return name if name in MODELS else Path(name).name


def print_report(result: dict, log=print):
    for name, m in result["models"].items():
        plain = {(r["batch"], r["dtype"]): r["tokens_per_s"] for r in m["rows"]
                 if r["side"].startswith("codraft plain")}
        hf = {r["batch"]: r["tokens_per_s"] for r in m["rows"] if r["side"] == "hf generate"}
        table = [[r["batch"], r["side"], r["tokens_per_s"], 1e3 * median(r["seconds"]),
                  r["tokens_per_s"] / plain[r["batch"], r["dtype"]] if (r["batch"], r["dtype"]) in plain else None,
                  r["tokens_per_s"] / hf[r["batch"]] if r["batch"] in hf else None,
                  r.get("tau_greedy"), r.get("tau_t1"), r.get("speedup_t1"), r.get("ms_per_forward"),
                  r["stats_greedy"]["mean_gamma"] if r["side"].startswith("codraft spec/") else None,
                  f"{r['verify_ms_per_round_t1']:.1f} / {r['draft_ms_per_round_t1']:.1f}"
                  if "draft_ms_per_round_t1" in r else "-",
                  {True: "yes", False: "NO"}.get(r.get("identical_to_plain"), "-")] for r in m["rows"]]
        log(f"\n{_label(name)} ({m['parameters'] / 1e6:.1f} M params, fp32), greedy, "
            f"{result['settings']['max_new_tokens']} new tokens/row, median of {result['settings']['repeats']}:")
        log(format_table(table, ["B", "side", "tok/s", "ms/call", "vs plain", "vs hf", "τ greedy", "τ T=1",
                                 "T=1 vs plain", "fwd ms", "drafts/row", "T=1 verify / draft ms a round", "= plain"]))
        for dtype in {d for b, d in plain if (b, "float32") in plain} - {"float32"}:
            log(f"plain decoding with {dtype} rollout weights vs float32: " + ", ".join(
                f"batch {b} {plain[b, dtype] / plain[b, 'float32']:.2f}x" for b, d in plain
                if d == dtype and (b, "float32") in plain))
    summary = summarize(result)
    if summary:
        log("\nbatch-1 plain decoding vs the memory-bandwidth bound (weight bytes / measured bandwidth):")
        log(format_table([[_label(s["model"]), s["dtype"], s["weight_MB"], s["bandwidth_GBps"], s["bound_ms"],
                           s["codraft_ms_per_step"], s["codraft_ms_per_token"], s["codraft_vs_bound"],
                           s.get("hf_ms_per_token"), s.get("hf_vs_bound"), s.get("codraft_speedup_vs_hf"),
                           s.get("speedup_vs_float32")] for s in summary],
                         ["model", "weights", "weights MB", "GB/s", "bound ms", "codraft fwd ms", "codraft ms/tok",
                          "x bound", "hf ms/tok", "x bound", "codraft/hf", "vs float32"]))


def run(models=("tiny", "smollm2"), batches=(1, 4, 16), max_new_tokens=128, drafts=DEFAULT_DRAFTS, gamma=4,
        threads=2, repeats=3, draft_init="auto", hf=True, json_path=None, gammas=None, dtypes=("float32",),
        t1_rows=16, log=print) -> dict:
    """gamma: the drafts' γ (auto's maximum); gammas: engine settings to compare per draft (ints, "auto";
    None: gamma alone, one side per draft as before); dtypes: rollout weight dtypes, float32 first."""
    if repeats < 1 or t1_rows < 1:
        raise ValueError(f"repeats and t1_rows must be >= 1, got {repeats} and {t1_rows}")
    if not dtypes or any(d not in _TAGS for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty list of {', '.join(_TAGS)}, got {list(dtypes)}")
    dtypes = sorted(set(dtypes), key=list(_TAGS).index)  # float32 (the baseline of the ratios) first
    unknown = [m for m in models if m not in MODELS and not Path(m).is_dir()]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)} or an HF-format folder")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    result = {"machine": machine_info(),
              "settings": {"models": list(models), "batches": list(batches), "max_new_tokens": max_new_tokens,
                           "drafts": list(drafts), "gamma": gamma, "gammas": gammas, "dtypes": dtypes,
                           "threads": threads,
                           "repeats": repeats,
                           "draft_init": draft_init, "t1_rows": t1_rows,
                           "decoding": "greedy, EOS disabled; *_t1: temperature 1, EOS on (as rollouts sample), "
                                       "t1_rows held-out prompts per repetition, B per call, a seed per call",
                           "timing": "median wall time of the whole generate call, sides interleaved"}}
    log(f"bench spec: {threads} threads, torch {torch.__version__}; measuring memory bandwidth ...")
    result["bandwidth"] = measure_bandwidth()
    result["models"] = {}
    for m in models:
        log(f"{m}: loading and building drafts ...")
        result["models"][m] = bench_model(m, batches=batches, max_new=max_new_tokens, drafts=drafts, gamma=gamma,
                                          repeats=repeats, draft_init=draft_init, hf=hf, gammas=gammas, dtypes=dtypes,
                                          t1_rows=t1_rows, log=log)
    result["bandwidth_after"] = measure_bandwidth()
    result["summary"] = summarize(result)
    result["machine"]["loadavg"] = os.getloadavg()
    print_report(result, log)
    if json_path:
        write_json(result, json_path, log)
    return result
