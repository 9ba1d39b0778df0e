"""`codraft bench rollout`: rollouts decoded by codraft's engine and by vLLM (``rollout.backend``), plain and
speculative, on the same policy, EAGLE-3 draft and prompts.

Per (backend, mode, batch B), on the first B held-out prompts of the policy's task (the same token ids for
every backend), ``max_new_tokens`` new tokens a row with EOS off (every call does the same work), at the
given temperature (0: greedy), a seed per repetition:

  tokens/s          new tokens / wall time of the whole ``generate`` call (prefill included), median of
                    ``repeats`` after a warm-up; the two modes' calls interleaved
  vs codraft plain  tokens/s over the codraft plain row of the same B in this run (the baseline)
  τ                 acceptance length over the timed calls (``SpecStats``: codraft's engine's rounds,
                    vLLM's per-request acceptance histograms: codraft.vllm.engine)
  refit             median seconds of what the trainer runs after an optimiser step before that engine decodes
                    again (codraft.bench.rollout_sides says what it is per backend)
  peak MB           the backend process's peak resident memory over the refits and timed calls, minus its
                    resident memory before the backend was built (codraft.bench.rollout_child); one figure
                    per backend, both modes and every batch together (vLLM builds both engines at once)
  = plain           greedy only: the speculative tokens equal the plain ones of the same backend (lossless)

Each backend runs in a process of its own, one after the other (codraft.bench.rollout_child); codraft's
with this process's environment, vLLM's with the venv's libiomp5 preloaded as docs/vllm.md says to run it.
Both use every core of this process's affinity (codraft: torch threads; vLLM: VLLM_CPU_OMP_THREADS_BIND).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from codraft.bench import format_table, machine_info, median, write_json
from codraft.config.taps import taps_problem
from codraft.drafts import init_draft, load_draft
from codraft.drafts.eagle3_layer import SERVED_TAPS, default_layers
from codraft.errors import MissingPackageError
from codraft.policy import load_policy
from codraft.tasks import make_task
from codraft.train.offline_draft import default_task_name, offline_draft_dir
from codraft.vllm.backend import check_policy
from codraft.vllm.environment import INSTALL

BACKENDS = ("codraft", "vllm")
DTYPES = ("float32", "bfloat16")
REPO = Path(__file__).resolve().parents[2]


def served_taps(num_layers: int) -> list[int]:
    """The EAGLE-3 taps vLLM can serve on a policy of ``num_layers`` layers: the default ones where they are
    three, else the first three (tiny policies: 0, 1, 2); never the last layer."""
    taps = default_layers(num_layers)
    taps = taps if len(taps) == SERVED_TAPS else list(range(SERVED_TAPS))
    problem = taps_problem(",".join(map(str, taps)), "eagle3", num_layers, key="the draft's taps")
    if problem:
        raise ValueError(f"bench rollout: {problem}")
    return taps


def _draft_dir(spec: str, policy, tok, policy_dir: Path, *, gamma: int, taps: list[int], tmp: Path) -> Path:
    """The EAGLE-3 draft's folder: "offline" (cached offline training on the policy's task, built on first
    use), "random" (untrained, seeded, saved under ``tmp``) or a saved draft's folder."""
    if spec == "offline":
        task = make_task(default_task_name(tok))
        return offline_draft_dir("eagle3", policy=policy, tok=tok, task=task, policy_dir=policy_dir, gamma=gamma,
                                 seed=0, layers=taps, skip="--draft random")
    if spec == "random":
        torch.manual_seed(0)
        init_draft("eagle3", policy, init="random", gamma=gamma, layers=taps).save(tmp / "draft")
        return tmp / "draft"
    if not Path(spec).is_dir():
        raise ValueError(f"--draft {spec!r}: not offline, random or a saved draft's folder")
    return Path(spec)


def _prompts(tok, n: int) -> list[list[int]]:
    """The first n held-out prompts of the task the policy's offline drafts train on."""
    return [tok.prompt_ids(p.prompt) for p in make_task(default_task_name(tok)).sample("val", n, seed=0)]


def _child_env(backend: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if backend == "vllm" and iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


def _measure(backend: str, job: dict, tmp: Path) -> dict:
    """Run codraft.bench.rollout_child for ``backend``; its errors reach stderr as they happen."""
    job_path, out_path = tmp / f"{backend}-job.json", tmp / f"{backend}-out.json"
    job_path.write_text(json.dumps(dict(job, backend=backend)))
    done = subprocess.run([sys.executable, "-m", "codraft.bench.rollout_child", str(job_path), str(out_path)],
                          env=_child_env(backend), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench rollout: the {backend} backend's process failed (exit {done.returncode}); "
                           "its error is above")
    return json.loads(out_path.read_text())


def add_ratios(rows: list[dict]) -> None:
    """Each row's tokens/s over the codraft plain row of its batch; at greedy, spec rows' tokens against
    their backend's plain ones."""
    plain = {(r["backend"], r["batch"]): r for r in rows if r["mode"] == "plain"}
    for r in rows:
        base = plain[("codraft", r["batch"])]
        r["vs_codraft_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        if r["mode"] == "spec" and r.get("greedy"):
            r["identical_to_plain"] = r["tokens"] == plain[(r["backend"], r["batch"])]["tokens"]


def _versions() -> dict:
    out = {}
    for name in ("vllm-cpu", "vllm"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def print_report(result: dict, log=print) -> None:
    s, per = result["settings"], result["backends"]
    table = [[r["backend"], r["mode"], r["batch"], r["tokens_per_s"], r["vs_codraft_plain"], r["tau"],
              1e3 * r["refit_median_s"], per[r["backend"]]["peak_mb"], per[r["backend"]]["build_s"],
              {True: "yes", False: "NO"}.get(r.get("identical_to_plain"), "-")] for r in result["rows"]]
    decoding = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']:g}"
    log(f"\n{s['policy']} + EAGLE-3 draft ({s['draft']}, γ={s['gamma']}, taps {s['taps']}), {s['dtype']}, "
        f"{decoding}, {s['max_new_tokens']} new tokens a row, median of {s['repeats']}:")
    log(format_table(table, ["backend", "mode", "B", "tok/s", "vs codraft plain", "τ", "refit ms", "peak MB",
                             "build s", "= plain"]))
    for name, b in per.items():
        log(f"refit, {name}: {b['refit_what']}")
    for name in per:  # a shared host: what other processes took while this backend was timed
        busy = [r["others_cores"] for r in result["rows"] if r["backend"] == name and r["others_cores"] is not None]
        if busy:
            log(f"{name}: {max(busy):.2f} cores at most busy elsewhere during its timed calls (of "
                f"{result['machine']['cpu_count']})")


def run(*, backends=BACKENDS, policy: str = "tiny-sft", draft: str = "offline", batches=(1, 8),
        max_new_tokens: int = 64, temperature: float = 1.0, gamma: int = 4, repeats: int = 3,
        dtype: str = "float32", kv_cache_gb: int = 1, json_path=None, log=print) -> dict:
    """backends: comma list members of ``BACKENDS``, codraft (the baseline) among them; policy: a policy name
    (tiny-sft, smollm2-135m) or an HF-format folder; draft: offline, random or a saved EAGLE-3 draft folder."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or "codraft" not in backends:
        raise ValueError(f"--backends must list codraft (the baseline of the ratios) and optionally vllm, "
                         f"got {','.join(backends)}")
    if not batches or min(batches) < 1 or max_new_tokens < 1 or repeats < 1 or gamma < 1 or temperature < 0:
        raise ValueError("--batches, --max-new-tokens, --repeats and --gamma must be >= 1 and --temperature >= 0")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        raise MissingPackageError(f"bench rollout --backends vllm needs vLLM, which is not installed; install it "
                                  f"with {INSTALL}")
    model, tok, policy_dir = load_policy(policy)
    if "vllm" in backends:
        check_policy(model.config, policy)
    with tempfile.TemporaryDirectory(prefix="codraft-bench-rollout-") as tmp:
        tmp = Path(tmp)
        draft_dir = _draft_dir(draft, model, tok, policy_dir, gamma=gamma,
                               taps=served_taps(model.config.num_hidden_layers), tmp=tmp)
        taps = sorted(load_draft(draft_dir, model, gamma=gamma).feature_layers)
        if "vllm" in backends and taps_problem(",".join(map(str, taps)), "eagle3", model.config.num_hidden_layers):
            raise ValueError(f"bench rollout: the draft in {draft_dir} taps layers {taps}, which vLLM cannot serve "
                             f"on this policy (it takes {SERVED_TAPS} layers below the last)")
        del model
        job = {"policy_dir": str(policy_dir), "draft_dir": str(draft_dir), "taps": taps, "gamma": gamma,
               "batches": list(batches), "max_new_tokens": max_new_tokens, "temperature": temperature,
               "repeats": repeats, "dtype": dtype, "kv_cache_gb": kv_cache_gb, "seed": 0,
               "prompts": _prompts(tok, max(batches))}
        result = {"machine": dict(machine_info(kernels=False), **_versions()),
                  "settings": {"backends": list(backends), "policy": policy, "policy_dir": str(policy_dir),
                               "draft": draft, "draft_dir": str(draft_dir), "taps": taps, "gamma": gamma,
                               "batches": list(batches), "max_new_tokens": max_new_tokens,
                               "temperature": temperature, "repeats": repeats, "dtype": dtype,
                               "kv_cache_gb": kv_cache_gb, "prompts": job["prompts"],
                               "decoding": "EOS off: every row decodes max_new_tokens; a seed per repetition",
                               "timing": "median wall time of the whole generate call, the modes interleaved"},
                  "backends": {}, "rows": []}
        for backend in backends:
            log(f"bench rollout: {backend} ...")
            out = _measure(backend, job, tmp)
            result["rows"] += out.pop("rows")
            result["backends"][backend] = out
    for r in result["rows"]:
        r["tokens_per_s"] = r["new_tokens"] / median(r["seconds"])
        r["refit_median_s"] = median(r["refit_s"])
        r["greedy"] = temperature == 0
    add_ratios(result["rows"])
    result["machine"]["loadavg"] = os.getloadavg()
    print_report(result, log)
    if json_path:
        write_json(result, json_path, log)
    return result
