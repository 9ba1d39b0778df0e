"""Data parallelism: the policy under FSDP2 (``parallel.dp_shard=fsdp``) or replicated (``ddp``).

``parallelize_policy`` wraps the plain model from outside, torchtitan's way: ``fully_shard`` on each
decoder layer, then on the root (the embedding, final norm and LM head), over the ``dp`` mesh dimension,
flattened with ``cp`` when CP is on (torchtitan's ``dp_shard_cp``: the CP ranks hold gradient shares of
one batch, so one reduce-scatter over dp × cp sums both). ``ddp`` uses FSDP2's ``replicate``: every rank
holds every parameter, gradients all-reduced. Either way the reduction is a plain *sum*
(``set_force_sum_reduction_for_comms`` + divide factor 1): the step's loss is already normalised by the
global token count (``codraft.rl.microbatch.Totals``), so the summed gradient is the single-process one.
(The sum is forced rather than left to the reduce op: gloo's reduce-scatter ignored the op in some torch
releases, PT #162338.)

Mixed precision stays ``grpo.precision``'s (bf16 products inside an fp32 forward), so no FSDP
``MixedPrecisionPolicy``: the shards and the AdamW state are fp32 masters.

The draft is small and every rank's rollout engine runs it, so it stays whole on every rank; its
gradients are summed over the same ranks in one all-reduce (``sync_gradients`` over ``mesh.data_group``).

After fully_shard the policy's parameters are DTensors: the rollout engine decodes from a full copy
that ``codraft.rollout.weights.RolloutWeights`` gathers after every update (the refit).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from codraft.models import Transformer
from codraft.parallel.comm import CPError
from codraft.parallel.mesh import Mesh

try:  # FSDP2's DDP (torch >= 2.8); private path, public behaviour
    from torch.distributed._composable.replicate_with_fsdp import replicate
except ImportError:  # pragma: no cover - older torch: the config rule names the fallback
    replicate = None


def parallelize_policy(policy: nn.Module, mesh: Mesh, mode: str) -> nn.Module:
    """Shard (``fsdp``) or replicate (``ddp``) ``policy`` in place over ``mesh.data_mesh`` (dp, × cp)."""
    ranks = mesh.data_mesh
    if mode == "fsdp":
        for layer in policy.layers:
            fully_shard(layer, mesh=ranks)
        fully_shard(policy, mesh=ranks)
    elif mode == "ddp":
        if replicate is None:
            raise RuntimeError("parallel.dp_shard=ddp needs torch >= 2.8 (FSDP2's replicate); use fsdp")
        replicate(policy, mesh=ranks)
    else:
        raise ValueError(f"parallel.dp_shard must be fsdp or ddp, got {mode!r}")
    for m in policy.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    return policy


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard only)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)



def full_policy(policy: nn.Module) -> nn.Module | None:
    """The sharded policy as one plain module on rank 0 (None elsewhere), for a checkpoint as the
    single-process run writes it, which any layout resumes from: collective."""
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not sd:
        return None
    with torch.device("meta"):  # no memory until the gathered tensors are assigned
        plain = Transformer(policy.config)
    plain.load_state_dict(sd, assign=True)
    return plain


@contextlib.contextmanager
def named_collectives(mesh: Mesh, what: str):
    """FSDP's all-gathers and reduce-scatters are plain torch.distributed calls: a peer that died or hung
    surfaces as the backend's error after parallel.timeout; say whose and what (other errors pass)."""
    try:
        yield
    except RuntimeError as e:
        if not (isinstance(e, dist.DistBackendError) or "gloo" in str(e)):
            raise
        raise CPError(f"{mesh.where()}: {what} failed: a data-parallel peer died or did not answer within "
                      f"parallel.timeout: {str(e).splitlines()[0]}") from e


def save_shards(policy: nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the policy and of its AdamW state to ``folder``
    (``torch.distributed.checkpoint``; rank 0 writes the metadata once all have written): collective."""
    dcp.save({"model": get_model_state_dict(policy), "optim": get_optimizer_state_dict(policy, opt)},
             checkpoint_id=folder)


def load_shards(policy: nn.Module, opt: torch.optim.Optimizer, folder: Path) -> None:
    """The policy and its AdamW state from a ``save_shards`` folder, resharded to this run's layout: FSDP
    shards at any dp, or whole tensors (one process, CP, PP). Collective where a process group exists."""
    state = {"model": get_model_state_dict(policy), "optim": get_optimizer_state_dict(policy, opt)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(policy, state["model"])
    set_optimizer_state_dict(policy, opt, state["optim"])


def load_full_optimizer_state(policy: nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    """A one-process checkpoint's optimiser state (parameter indices, whole tensors) into the sharded
    policy's optimiser: every rank passes the whole state and keeps its shards (collective)."""
    names = [n for n, _ in policy.named_parameters()]
    by_name = {"state": {names[i]: v for i, v in sd["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}
    set_optimizer_state_dict(policy, opt, by_name, options=StateDictOptions(full_state_dict=True))
