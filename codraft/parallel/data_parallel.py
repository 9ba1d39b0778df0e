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

The co-trained draft gets the same choice (``parallelize_draft``, one FSDP group: it is small); every
rank's engine decodes with a whole copy of it, refreshed with the policy's.

After fully_shard the policy's parameters are DTensors: the rollout engine decodes from a full copy
that ``codraft.rollout.weights.RolloutWeights`` gathers after every update (the refit).

Checkpoints: ``save_shards`` / ``load_shards`` write and read every rank's shards with
torch.distributed.checkpoint (resharded to the layout that loads them); ``full_policy`` / ``full_state``
gather whole weights to rank 0 for the HF folder and ``draft.pt``; ``load_full_state`` shards a
one-process checkpoint's state on load. ``named_collectives`` names a peer that died or hung inside
FSDP's own collectives.
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
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from codraft.models import Transformer
from codraft.parallel.comm import CPError
from codraft.parallel.mesh import Mesh

try:  # FSDP2's DDP (torch >= 2.8); private path, public behaviour
    from torch.distributed._composable.replicate_with_fsdp import replicate
except ImportError:  # pragma: no cover - older torch: parallel.dp_shard=ddp is refused in _wrap
    replicate = None


def _wrap(module: nn.Module, parts: list[nn.Module], ranks, mode: str) -> None:
    if mode == "fsdp":
        for part in parts:  # each its own all-gather / reduce-scatter group, bottom-up
            fully_shard(part, mesh=ranks)
        fully_shard(module, mesh=ranks)
    elif mode == "ddp":
        if replicate is None:
            raise RuntimeError("parallel.dp_shard=ddp needs torch >= 2.8 (FSDP2's replicate); use fsdp")
        replicate(module, mesh=ranks)
    else:
        raise ValueError(f"parallel.dp_shard must be fsdp or ddp, got {mode!r}")
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)


def parallelize_policy(policy: nn.Module, mesh: Mesh, mode: str) -> nn.Module:
    """Shard (``fsdp``: each decoder layer, then the root) or replicate (``ddp``) ``policy`` in place over
    ``mesh.data_mesh`` (dp, × cp)."""
    _wrap(policy, list(policy.layers), mesh.data_mesh, mode)
    return policy


def parallelize_draft(draft: nn.Module, mesh: Mesh, mode: str) -> nn.Module:
    """The co-trained draft, sharded or replicated as the policy (one group: it is small). Its loss is a
    method, not ``forward``: registered so that FSDP gathers the parameters around it (``loss_normaliser``
    reads the batch alone)."""
    _wrap(draft, [], mesh.data_mesh, mode)
    register_fsdp_forward_method(draft, "loss")
    return draft


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard only)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def full_policy(policy: nn.Module) -> nn.Module | None:
    """The sharded policy as one plain module on rank 0 (None elsewhere), for a checkpoint as the
    single-process run writes it, which any layout resumes from: collective."""
    sd = full_state(policy)
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


def save_shards(parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]], folder: Path) -> None:
    """Every rank writes its shards of each module and its optimiser state (``parts``: name -> (module,
    optimiser)) to ``folder`` (``torch.distributed.checkpoint``; rank 0 writes the metadata once all have
    written): collective."""
    dcp.save(_state(parts), checkpoint_id=folder)


def load_shards(parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]], folder: Path) -> None:
    """Each module and its optimiser state from a ``save_shards`` folder, resharded to this run's layout:
    FSDP shards at any dp, or whole tensors (one process, CP, PP). Collective where a process group exists."""
    state = _state(parts)
    dcp.load(state, checkpoint_id=folder)
    for name, (module, opt) in parts.items():
        set_model_state_dict(module, state[name])
        set_optimizer_state_dict(module, opt, state[f"{name}_optim"])


def _state(parts: dict) -> dict:
    state = {}
    for name, (module, opt) in parts.items():
        state[name], state[f"{name}_optim"] = get_model_state_dict(module), get_optimizer_state_dict(module, opt)
    return state


def load_full_state(module: nn.Module, opt: torch.optim.Optimizer, weights: dict | None, sd: dict) -> None:
    """A one-process checkpoint's weights (None: already loaded) and optimiser state (parameter indices over
    the trained parameters, whole tensors) into a sharded module: every rank passes the whole state and
    keeps its shards (collective)."""
    full = StateDictOptions(full_state_dict=True)
    if weights is not None:
        set_model_state_dict(module, weights, options=full)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    by_name = {"state": {names[i]: v for i, v in sd["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]}
    set_optimizer_state_dict(module, opt, by_name, options=full)


def full_state(module: nn.Module) -> dict:
    """A sharded module's state dict as whole tensors on rank 0 (empty elsewhere): collective."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
