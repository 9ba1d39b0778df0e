"""`codraft train parallel.tp=2` under torchrun: the same metrics per step as one process over the same prompts;
its checkpoint (every rank's shards, DCP) resumes at another tensor-parallel degree — in one process, and at
dp=2 without tp — and a one-process checkpoint resumes at tp=2, each with the next step equal to the
one-process run's resumed the same way."""
from __future__ import annotations

import json
import shutil

from test_dp_train import ARGS, _codraft, _rows, _same, one_process  # noqa: F401 (a fixture)


def test_torchrun_tp2_equals_single_process_and_resumes_across_tp_degrees(tmp_path, one_process):  # noqa: F811
    ref, at_two = one_process
    want = _rows(ref)
    run = tmp_path / "tp2"
    _codraft(2, "steps=2", f"run_dir={run}", "parallel.tp=2", *ARGS)
    got = _rows(run)
    for step in (1, 2):
        _same(got[step], want[step])
    assert got[1]["time_refit"] > 0  # the engine's whole copy gathered from the shards
    step = run / "step_2"
    assert len(list((step / "sharded").glob("*.distcp"))) == 2 and (step / "policy" / "config.json").is_file()

    other = tmp_path / "tp2-then-dp2"
    shutil.copytree(run, other)
    _codraft(1, "--resume", str(run), "steps=3", "parallel.tp=1")
    _codraft(2, "--resume", str(other), "steps=3", "parallel.tp=1", "parallel.dp=2")
    spread = tmp_path / "one-then-tp2"
    shutil.copytree(at_two, spread)
    _codraft(2, "--resume", str(spread), "steps=3", "parallel.tp=2")
    for folder, changed in ((run, {"parallel.tp"}), (other, {"parallel.tp", "parallel.dp"}), (spread, {"parallel.tp"})):
        _same(_rows(folder)[3], want[3])
        log = [json.loads(line) for line in (folder / "resume_log.jsonl").read_text().splitlines()]
        assert log[-1]["step"] == 2 and changed <= set(log[-1]["changed"])
