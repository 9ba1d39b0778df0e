"""The co-training step over micro-batches and pipeline stages (``parallel.pp``, ``parallel.microbatches``).

Every rank's engine decodes with the whole policy and draft, but in the update a stage runs only its
own decoder layers (``stage_layers``; the first also embeds, the last also runs the head and both
losses), keeps gradients and optimiser state only for the parameters it owns, and after the optimiser
step broadcasts them to every rank: the weight sync from trainer to rollout engine that RL systems do
after each update. (With ``parallel.dp_shard=fsdp`` and dp > 1 a stage's parameters are sharded over its
data ranks and the engine holds a separate copy: ``codraft.parallel.sharded_stages``.) With ``pp = 1`` the
same code is plain gradient accumulation over micro-batches.

The taps: a stage puts the taps among its layers on the TapChannel after it has sent its
activations; the last stage gets them before the draft loss of that micro-batch (``shm`` / ``p2p``,
or the baselines ``staging``: pickled through the host, and ``relay``: appended to the
activations inside the schedule). The schedule itself is the same with or without taps.

The tied embedding / LM head is owned by the first and the last stage: their two gradient shares
are summed (``embedding`` group), both apply the same update, and the first stage's copy is the
one broadcast. Gradient clipping uses the global norm (each weight counted once).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from codraft.models.bf16 import products
from codraft.models.moe import Routing
from codraft.parallel.context import sync_gradients
from codraft.parallel.data_parallel import local
from codraft.parallel.mesh import Mesh
from codraft.parallel.pipeline import PipelineError, StageLink, run_schedule, stage_layers, stage_parameters
from codraft.parallel.tap_staging import open_staging_channel
from codraft.parallel.tapchannel import TapSpec, open_tap_channel
from codraft.parallel.tp import grads_as_params, split_over_tp
from codraft.rl.cotrain import draft_taps, loss_from_hidden, packed_row
from codraft.rl.microbatch import MicroBatch, merge_metrics, with_draft_normaliser

TRANSPORTS = ("shm", "p2p", "staging", "relay")


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its layers, its link to the neighbours, the tap channel."""
    mesh: Mesh | None
    layers: range
    transport: str
    link: StageLink
    channel: object = None

    @property
    def stage(self) -> int:
        return 0 if self.mesh is None else self.mesh.stage

    @property
    def stages(self) -> int:
        return 1 if self.mesh is None else self.mesh.pp

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def sharded(self) -> bool:
        """Each stage's parameters sharded over its data ranks by FSDP2 (``codraft.parallel.sharded_stages``)."""
        return self.mesh is not None and self.mesh.layout.sharded_stages


def build_pipeline(policy, draft, mesh: Mesh | None, *, transport: str = "shm", max_tokens: int = 0,
                   timeout: float = 300.0) -> Pipeline:
    """Collective over the world when ``mesh.pp`` > 1 (the tap channels' groups): every rank calls it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown tap transport {transport!r}: one of {', '.join(TRANSPORTS)}")
    pp = 1 if mesh is None else mesh.pp
    bounds = stage_layers(policy.config.num_hidden_layers, pp)
    taps = tuple(draft.feature_layers) if draft is not None else ()
    stage_taps = tuple(tuple(sorted(t for t in taps if t in b)) for b in bounds)
    stage = 0 if mesh is None else mesh.stage
    link = StageLink(stage, pp, None if mesh is None else mesh.pp_group, timeout,
                     where="" if mesh is None else mesh.where())
    pipe = Pipeline(mesh, bounds[stage], transport, link)
    if pp > 1 and taps and transport != "relay":
        dev = str(policy.embed_tokens.weight.device)
        spec = TapSpec(max_tokens=max_tokens, hidden=policy.config.hidden_size, taps=stage_taps,
                       in_flight=pp, dtype=policy.embed_tokens.weight.dtype, timeout=timeout, device=dev)
        # one channel per column (replica, CP rank, TP rank: each TP rank's last stage reads the same taps, whole);
        # every rank takes part in making each
        for d, c, t in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
            column = mesh.column(c, d, t)
            ch = open_staging_channel(spec, column) if transport == "staging" else open_tap_channel(spec, transport, column)
            if (d, c, t) == (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank):
                pipe.channel = ch
    return pipe


@contextlib.contextmanager
def _naming(pipe: Pipeline, what: str):
    """A tap transfer that fails (a dead or hung peer: the channel's timeout, or gloo's own error) is a
    ``PipelineError`` naming this stage, the tap and the micro-batch, as the activations' are."""
    try:
        yield
    except RuntimeError as e:
        raise PipelineError(f"{pipe.link.who}: {what}: {e}") from e


def pipeline_cotrain(pipe: Pipeline, policy, draft, mbs: list[MicroBatch], *, step: int, train_draft: bool = True,
                     policy_dtype: torch.dtype = torch.float32, merged: bool = True, **loss_kw
                     ) -> tuple[torch.Tensor, dict | list[dict]]:
    """Forward and backward of the step's micro-batches on this stage (1F1B); gradients accumulate in
    the parameters this stage runs. Returns the step's loss and metrics (``merged=False``: each
    micro-batch's), on every rank."""
    mesh, last = pipe.mesh, pipe.last
    if last and len(mbs) > 1 and draft is not None and train_draft and mbs[0].totals.draft_norm is None:
        # the draft loss's denominators: the step's (given already when these are a share of the step)
        mbs = with_draft_normaliser(mbs, draft, loss_kw.get("draft_seed"))
    taps = draft_taps(draft, train_draft) or ()
    mine = tuple(t for t in taps if t in pipe.layers)
    before = [t for t in taps if t < pipe.layers.start]  # relay: what arrives with the activations
    rows = [packed_row(mb.batch, None if mesh is None else mesh.cp_group) for mb in mbs]
    inputs = [row.model_inputs() for row in rows]
    hidden_size = policy.config.hidden_size
    relay = pipe.transport == "relay"
    tapped, parts = {}, [None] * len(mbs)

    def forward(m, x, carried):
        ids, kw = inputs[m]
        ctx = policy.layer_inputs(1, ids.shape[1], ids.device, **kw)
        replay = mbs[m].replay  # routing replay: this stage's MoE layers route as the rollout did
        with products(policy_dtype), contextlib.nullcontext() if replay is None else \
                Routing(policy, rows[m].local(replay)):
            out, tapped[m] = policy.run_layers(policy.embed(ids) if x is None else x, ctx, pipe.layers, mine)
        if last or not relay:
            return out, carried
        cols = ([] if carried is None else [carried]) + [tapped[m][t].detach() for t in mine]
        return out, torch.cat(cols, -1) if cols else None

    def after_forward(m):
        own = tapped.pop(m)
        if pipe.channel is not None:
            for t in mine:
                with _naming(pipe, f"cannot send tap {t} of micro-batch {m} to the last stage"):
                    pipe.channel.put(step, m, t, own[t][0])

    def loss(m, hidden, carried):
        own = tapped.pop(m, {})
        feats = {}
        for t in taps:
            if t in own:
                feats[t] = own[t]
            elif relay:
                i = before.index(t)
                feats[t] = carried[..., i * hidden_size:(i + 1) * hidden_size]
            else:
                with _naming(pipe, f"no tap {t} of micro-batch {m}"):
                    feats[t] = pipe.channel.get(step, m, t)[None]
        mb = mbs[m]
        out, parts[m] = loss_from_hidden(policy, draft, mb.batch, rows[m], hidden, rows[m].draft_features(feats),
                                         mb.advantages, train_draft=train_draft, totals=mb.totals,
                                         policy_dtype=policy_dtype, **loss_kw)
        return out

    sharded = [policy] + ([draft] if last and train_draft and draft is not None else [])

    def before_backward(final):  # sharded stages: FSDP sums the stage's gradients after its last backward only
        for module in sharded:
            module.set_requires_gradient_sync(final)

    w = policy.embed_tokens.weight
    losses = run_schedule(pipe.link, len(mbs), forward=forward, loss=loss,
                          shape=lambda m: (1, inputs[m][0].shape[1], hidden_size), dtype=w.dtype, device=w.device,
                          extra=hidden_size * len(before) if relay else 0,
                          after_forward=None if last else after_forward,
                          before_backward=before_backward if pipe.sharded else None)
    result = (torch.stack(losses).sum(), merge_metrics(parts, mbs) if merged else parts) if last else None
    if pipe.stages > 1:  # the last stage's loss and metrics, to every rank
        shared = mesh.world.all_gather_object(result, "the step's loss and metrics")
        result = shared[mesh.rank_of(pipe.stages - 1)]
    return result


# ---------------------------------------------------------------- gradients and weights under PP


def reduce_gradients(pipe: Pipeline, policy, draft_params: list) -> tuple[list, list]:
    """Sum the DP and CP ranks' shares (FSDP has, where it shards the stages) and the tied weight's two stage
    shares (shard by shard); returns (policy params, draft params) this rank owns, every one with a gradient
    (zeros where its micro-batches gave none)."""
    mesh = pipe.mesh
    own = stage_parameters(policy, pipe.stage, pipe.stages)
    drafts = draft_params if pipe.last else []
    for p in own + drafts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads_as_params(own)  # (the tied weight's two shares are summed shard by shard)
    shares = None if mesh is None else mesh.data_group or mesh.cp_group  # the ranks of a stage: dp (× cp), or cp
    if shares is not None and not pipe.sharded:
        sync_gradients(own, shares, "policy")
        sync_gradients(drafts, shares, "draft")
    tied = policy.lm_head is None
    if pipe.stages > 1 and tied and (pipe.stage == 0 or pipe.last):
        g = local(policy.embed_tokens.weight.grad)
        try:
            dist.all_reduce(g, group=mesh.embedding)
        except RuntimeError as e:
            raise PipelineError(f"{mesh.where()}: summing the tied embedding's gradient with the other end of "
                                f"the pipeline failed: {e}") from e
    return own, drafts


def clip_gradients(pipe: Pipeline, policy, own: list, drafts: list, max_policy: float, max_draft: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip by the global norms (over all stages; the tied weight counted once) -> the two norms."""
    tied_twice = pipe.stages > 1 and pipe.last and policy.lm_head is None
    # on the gradients' device: an NCCL group reduces device tensors only; [policy, draft, policy's TP shards]
    sq = torch.zeros(3, dtype=torch.float64, device=local(own[0].grad).device)
    for p in own:
        if not (tied_twice and p is policy.embed_tokens.weight):
            sq[2 if split_over_tp(p.grad) else 0] += local(p.grad).detach().double().pow(2).sum()
    for p in drafts:
        sq[1] += local(p.grad).detach().double().pow(2).sum()
    if pipe.sharded:  # the shards' squares: summed over the stage's data ranks
        pipe.mesh.data_group.all_reduce(sq, "the gradient norms' shards")
    if pipe.mesh is not None and pipe.mesh.tp > 1:  # the tensor-parallel shards' squares: summed over tp
        try:
            dist.all_reduce(sq[2:], group=pipe.mesh.tp_mesh.get_group())
        except RuntimeError as e:
            raise PipelineError(f"{pipe.mesh.where()}: summing the gradient norms over the tensor-parallel ranks "
                                f"failed: {e}") from e
    sq = torch.stack([sq[0] + sq[2], sq[1]])
    if pipe.stages > 1:
        try:
            dist.all_reduce(sq, group=pipe.mesh.pp_group)
        except RuntimeError as e:
            raise PipelineError(f"{pipe.mesh.where()}: summing the gradient norms over the pipeline's stages "
                                f"failed: {e}") from e
    norms = sq.sqrt().float()
    for params, norm, limit in ((own, norms[0], max_policy), (drafts, norms[1], max_draft)):
        if limit is not None:
            coef = (limit / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                local(p.grad).mul_(coef.to(p.grad.dtype))
    return norms[0], None if max_draft is None else norms[1]


def sync_weights(pipe: Pipeline, policy, draft_params: list) -> None:
    """After the update: every stage's parameters (and the draft, from the last stage) to every rank (sharded
    stages: the refit does, into the engine's copy)."""
    mesh = pipe.mesh
    if pipe.sharded:
        return
    for s in range(pipe.stages if pipe.stages > 1 else 0):  # (replicas agree after the DP sum: replica 0's)
        _broadcast(stage_parameters(policy, s, pipe.stages, tied_once=True), mesh.rank_of(s, dp_rank=0), mesh,
                   f"stage {s}'s weights")  # (tensor parallelism: each TP rank's shards among its own TP rank)
    if pipe.stages > 1:
        _broadcast(list(draft_params), mesh.rank_of(pipe.stages - 1, dp_rank=0), mesh, "the draft's weights")


def _broadcast(params: list, src: int, mesh: Mesh, what: str) -> None:
    if not params:
        return
    with torch.no_grad():
        shards = [local(p) for p in params]
        flat = torch.cat([t.detach().reshape(-1) for t in shards])
        try:
            dist.broadcast(flat, src, group=mesh.same_tp)
        except RuntimeError as e:
            raise PipelineError(f"{mesh.where()}: the weight sync of {what} from rank {src} failed: {e}") from e
        if mesh.world.rank != src:
            o = 0
            for t in shards:
                t.copy_(flat[o:o + t.numel()].view_as(t))
                o += t.numel()
