"""The update's path between rl/ and parallel/ (``scripts/update_walk.py``: ``sys.setprofile`` over one
``Trainer.update`` of the tiny preset): rl/ hands the step to the layout's machinery once and calls it once
more after the optimiser steps; everything else crosses the other way, the machinery calling the step's
objective (its cuts, rows and losses). In one process, and with micro-batches (the 1F1B schedule)."""
import importlib.util
from pathlib import Path

import pytest

from codraft.rl.cotrain import Row
from codraft.rl.objective import CoTraining

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides", [[], ["parallel.microbatches=2"]], ids=["one-batch", "microbatches"])
def test_rl_hands_the_update_to_the_parallel_machinery_and_is_called_back_only_as_the_objective(overrides):
    spec = importlib.util.spec_from_file_location("update_walk", ROOT / "scripts" / "update_walk.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    walk = script.walk(overrides)  # (what the script prints as JSON)
    assert walk["rl_to_parallel"] == ["rl.commit -> parallel.after_optimizer",
                                      "rl.update -> parallel.forward_backward"]
    called = {e.split(" -> rl.")[1] for e in walk["parallel_to_rl"]}
    assert called and called <= set(dir(CoTraining)) | set(dir(Row)), called
