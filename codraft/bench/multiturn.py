"""`codraft bench multiturn`: how environment time bounds the end-to-end gain of faster decoding in
multi-turn tool-calling RL (the paper's Amdahl effect: a 1.75-2.23× faster rollout gave 1.25-1.43× end
to end on agentic work, where the rollout was 55.8 % of the step).

For each ``--latency-ms`` value L: a ``Trainer`` on the preset (``--config``, default ``tiny-tools``:
the ``lookup`` environment, two tool calls per episode) with ``env.latency_ms=L`` (every tool call
sleeps L ms first) and ``log.speedup_every=1``: every step also decodes the same prompts with the
same seed and environment without the draft (``time_rollout_plain``, not part of the step).
Validation and checkpoints are off. Per step, from the trainer's own metrics:

* ``rollout_speedup`` = time_rollout_plain / time_rollout (speculative against plain decoding);
* ``rollout_share`` = time_rollout / time_step;
* ``e2e_speedup`` = (time_step - time_rollout + time_rollout_plain) / time_step: the step with a
  plain rollout against the step as it ran (the rest of the step, reward and update, is the same);
* ``env_wait_share``: time with no row to decode (every row waiting on its tool) / time_rollout.

Medians over ``--steps`` steps after one warm-up step. As L grows, the tool waits (which decoding
does not shorten) take a larger share of the rollout and of the step, and e2e_speedup falls towards 1
even where rollout_speedup of the decoding itself holds. Every row carries the CPU model and date.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile

from codraft.bench import format_table, machine_info
from codraft.config import load_config
from codraft.rl.trainer import Trainer

COLUMNS = ("latency_ms", "time_step", "time_rollout", "time_rollout_plain", "time_env_wait", "rollout_speedup",
           "rollout_share", "e2e_speedup", "env_wait_share", "turns_mean", "acceptance_length")


def _row(m: dict) -> dict:
    step, roll, plain = m["time_step"], m["time_rollout"], m["time_rollout_plain"]
    return {"time_step": step, "time_rollout": roll, "time_rollout_plain": plain, "time_env_wait": m["time_env_wait"],
            "rollout_speedup": plain / roll, "rollout_share": roll / step,
            "e2e_speedup": (step - roll + plain) / step, "env_wait_share": m["time_env_wait"] / roll,
            "turns_mean": m["turns_mean"], "acceptance_length": m.get("acceptance_length")}


def run(*, config: str = "tiny-tools", latencies=(0.0, 20.0, 100.0), steps: int = 4, overrides=(),
        json_path: str | os.PathLike | None = None, log=print) -> dict:
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    result = {"bench": "multiturn", "machine": machine_info(), "config": config, "steps": steps,
              "overrides": list(overrides), "rows": []}
    tmp = tempfile.mkdtemp(prefix="codraft-bench-multiturn-")
    try:
        for latency in latencies:
            cfg = load_config(config, [*overrides, f"env.latency_ms={latency}", "log.speedup_every=1",
                                       "log.val_every=0", "log.checkpoint_every=0", f"run_dir={tmp}/l{latency:g}",
                                       f"steps={steps + 1}"])
            if cfg.env.name == "none":
                raise ValueError(f"config {config!r} has no environment (env.name=none): nothing multi-turn to time")
            tr = Trainer(cfg, progress=False)
            try:
                rows = []
                for step in range(steps + 1):  # step 0: warm-up (first calls, lazy set-up)
                    m = tr.step(step)
                    if step:
                        rows.append(_row(m))
                    log(f"  latency {latency:g} ms, step {step}: step {m['time_step']:.2f} s, rollout "
                        f"{m['time_rollout']:.2f} s (plain {m['time_rollout_plain']:.2f} s)")
            finally:
                tr.logger.close()
                tr._unlock()
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
            result["rows"].append({"latency_ms": latency, **med})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"\n{result['machine']['processor']}, {result['machine']['date']}: medians of {steps} steps, {config}")
    log(format_table([[r.get(c) for c in COLUMNS] for r in result["rows"]], list(COLUMNS)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {json_path}")
    return result
