"""vLLM's distributed world inside a torchrun rank (parallel.dp > 1): each rank's engine decodes alone.

A vLLM worker joins torch.distributed as it starts (``init_worker_distributed_environment``). Under torchrun
the trainer's default group already exists, so vLLM does not make its own: it makes its world group over
all the trainer's ranks and lays its groups out as "ExternalDP x DP x PP x PCP x TP"
(``vllm/distributed/parallel_state.py::initialize_model_parallel``), the leading dimension being the ranks
outside its model, "every dp rank can generate independently (in verl integration)". With tp = pp = dp = 1
every rank's TP/PP/DP groups hold that rank alone and the engine runs no collective while it decodes
(measured: dp=2, one engine per rank, each rank's shards equal the one-process run's). The groups are made
with ``new_group``, collectively: every rank builds its engines at the same point of the run, as the
trainer does.

What must be undone: vLLM destroys its groups when an engine shuts down, at the interpreter's exit, after
the trainer has destroyed the default group and every group made from it; vLLM's then fail ("Invalid process
group specified", a traceback per rank). ``release`` destroys vLLM's groups (and with them the default group,
as vLLM's own teardown does) while they are valid, so its exit-time teardown finds nothing left.
"""
from __future__ import annotations


def release() -> None:
    """Destroy vLLM's process groups and the default group (the trainer's last step under torchrun)."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
