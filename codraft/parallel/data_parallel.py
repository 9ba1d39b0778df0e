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
torch.distributed.checkpoint (resharded to the layout that loads them; read through ``codraft.models.shard_files``,
which runs no code pickled in the folder); ``full_policy`` / ``full_state``
gather whole weights to rank 0 for the HF folder and ``draft.pt``; ``load_full_state`` shards a
one-process checkpoint's state on load. ``named_collectives`` names a peer that died or hung inside
FSDP's own collectives.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from codraft.errors import CodraftError
from codraft.models import Transformer
from codraft.models.shard_files import ShardPlanner, ShardReader
from codraft.parallel.comm import PeerError
from codraft.parallel.mesh import Mesh

try:  # FSDP2's DDP (torch >= 2.8); private path, public behaviour
    from torch.distributed._composable.replicate_with_fsdp import replicate
except ImportError:  # pragma: no cover - older torch: parallel.dp_shard=ddp is refused in wrap
    replicate = None


def wrap(module: nn.Module, parts: list[nn.Module], ranks, mode: str, ignored: set | None = None) -> None:
    """``fsdp``: each of ``parts`` its own FSDP2 unit, then ``module`` (without ``ignored``); ``ddp``:
    replicated. Gradients are summed over ``ranks``, not averaged."""
    if mode == "fsdp":
        for part in parts:  # each its own all-gather / reduce-scatter group, bottom-up
            fully_shard(part, mesh=ranks)
        fully_shard(module, mesh=ranks, ignored_params=ignored)
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
    wrap(policy, list(policy.layers), mesh.data_mesh, mode)
    return policy


def parallelize_draft(draft: nn.Module, mesh: Mesh, mode: str) -> nn.Module:
    """The co-trained draft, sharded or replicated as the policy (one group: it is small). Its loss is a
    method, not ``forward``: registered so that FSDP gathers the parameters around it (``loss_normaliser``
    reads the batch alone)."""
    wrap(draft, [], mesh.data_mesh, mode)
    register_fsdp_forward_method(draft, "loss")
    return draft


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor's local shard only)."""
    return sum(local(t).nbytes for t in tensors if t is not None)


def full_policy(policy: nn.Module) -> nn.Module | None:
    """The sharded policy as one plain module on rank 0 (None elsewhere), for a checkpoint as the
    single-process run writes it, which any layout resumes from: collective."""
    sd = full_state(policy)
    return plain_policy(policy.config, sd) if sd else None


def plain_policy(config, weights: dict) -> nn.Module:
    """A plain ``Transformer`` holding ``weights`` (whole tensors, taken as they are)."""
    with torch.device("meta"):  # no memory until the gathered tensors are assigned
        plain = Transformer(config)
    plain.load_state_dict(weights, assign=True)
    return plain


@contextlib.contextmanager
def named_collectives(mesh: Mesh, what: str, peer: str = "data-parallel"):
    """FSDP's all-gathers and reduce-scatters (and tensor parallelism's all-reduces) are plain torch.distributed
    calls: a peer that died or hung surfaces as the backend's error after parallel.timeout; say whose and what
    (other errors, and ours, which name their peer already, pass)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CodraftError) or not (isinstance(e, dist.DistBackendError) or "gloo" in str(e)):
            raise
        raise PeerError(f"{mesh.where()}: {what} failed: a {peer} peer died or did not answer within "
                        f"parallel.timeout: {str(e).splitlines()[0]}") from e


# parts: name -> (module, its optimiser, the names of the module's tensors this rank holds, or None: all)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # one key per parameter: ranks may hold different ones


def save_shards(parts: dict[str, tuple], folder: Path) -> None:
    """Every rank writes its part of each module and its optimiser state (``parts``) to ``folder``
    (``torch.distributed.checkpoint``: FSDP shards, or whole tensors, which ranks holding the same write once;
    rank 0 writes the metadata once all have written): collective."""
    dcp.save(_state(parts), checkpoint_id=folder)


def load_shards(parts: dict[str, tuple], folder: Path) -> None:
    """Each rank's part of each module and its optimiser state from a ``save_shards`` folder, resharded to
    this run's layout. Collective where a process group exists."""
    reader = ShardReader(folder)  # DCP's reader and planner, but never unpickling code from the folder
    saved = reader.read_metadata().state_dict_metadata
    # optimiser states by group index, as codraft wrote them before 2026-12-06 (every rank held every parameter)
    options = {name: StateDictOptions() if f"{name}_optim.param_groups.0.lr" in saved else FLAT for name in parts}
    state = _state(parts, options)
    try:
        dcp.load(state, storage_reader=reader, planner=ShardPlanner(folder))
    except CheckpointException as e:  # DCP gathers every rank's failure: ours is one line naming the file
        raise next((exc for exc, _ in e.failures.values() if isinstance(exc, CodraftError)), e) from None
    for name, (module, opt, held) in parts.items():
        set_model_state_dict(module, state[name], options=StateDictOptions(strict=held is None))
        with _same_kernel(opt):
            set_optimizer_state_dict(module, opt, state[f"{name}_optim"], options=options[name])


def _state(parts: dict, options: dict | None = None) -> dict:
    state = {}
    for name, (module, opt, held) in parts.items():
        sd = get_model_state_dict(module)
        state[name] = sd if held is None else {k: v for k, v in sd.items() if k in held}
        state[f"{name}_optim"] = get_optimizer_state_dict(module, opt, options=(options or {}).get(name, FLAT))
    return state


def load_full_state(module: nn.Module, opt: torch.optim.Optimizer, weights: dict | None, sd: dict,
                    names: list[str]) -> None:
    """A one-process checkpoint's weights (None: already loaded) and optimiser state (whole tensors, keyed
    by indices into ``names``) into this rank's part of ``module`` (its shards, its stage's tensors):
    every rank passes the whole state and keeps its part (collective where ``module`` is sharded)."""
    full = StateDictOptions(full_state_dict=True)
    if weights is not None:
        set_model_state_dict(module, weights, options=full)
    mine = {id(p) for g in opt.param_groups for p in g["params"]}
    held = {n for n, p in module.named_parameters() if id(p) in mine}
    by_name = {"state": {names[i]: v for i, v in sd["state"].items() if names[i] in held},
               "param_groups": [{**g, "params": [names[i] for i in g["params"] if names[i] in held]}
                                for g in sd["param_groups"]]}
    with _same_kernel(opt):
        set_optimizer_state_dict(module, opt, by_name, options=full)


@contextlib.contextmanager
def _same_kernel(opt: torch.optim.Optimizer):
    """Loading a state takes the saved param groups' ``fused``/``foreach``: keep this layout's choice (a fused
    AdamW refuses tensor parallelism's mix of plain and DTensor parameters, ``update_phase.adamw``)."""
    kept = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in opt.param_groups]
    yield
    for g, k in zip(opt.param_groups, kept):
        g.update(k)


def full_state(module: nn.Module) -> dict:
    """A sharded module's state dict as whole tensors on rank 0 (empty elsewhere): collective."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
