"""The trainer's checkpoints (``codraft.train.checkpoint`` writes and reads them): ``save`` writes the last
completed step, ``resume_from`` continues from one.

One process writes one consolidated checkpoint. A run of several ranks (any layout) also writes every
rank's part with torch.distributed.checkpoint (``sharded/``): its shards (FSDP) or its stage's tensors
(PP) of the policy, the co-trained draft where it trains it, and their optimiser states; a resume at any
layout reads its own part of them (DCP reshards). Rank 0 writes the rest: the whole policy as an HF folder
and the whole draft (gathered where they are sharded), the schedulers, counters and RNG; a Ctrl-C during
the write waits for it. A checkpoint carries the draft, optimisers and schedulers, the prompt counter and,
with draft_length=auto, the running acceptance estimates, so a resumed run repeats an uninterrupted one's
rollouts and updates.

A write that fails stops every rank alike: the ranks' DCP write fails on all of them, and rank 0 tells the
others how its own write went. A full disk is one line on each (``DiskFullError``: the folder, about how
many bytes the checkpoint needs and how many are free); the temporary folders are removed, and the
previous checkpoint stays.
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from codraft.parallel.data_parallel import full_policy, full_state, load_full_state, load_shards, plain_policy, \
    save_shards
from codraft.rl.interrupt import hold_signals
from codraft.train import checkpoint as ckpt
from codraft.train.disk_full import checkpoint_full, is_disk_full

if TYPE_CHECKING:
    from codraft.rl.trainer import Trainer


def save(tr: Trainer) -> Path | None:
    """Checkpoint the last completed step (`steps_done`): every rank's part (several ranks), then rank 0
    writes the consolidated rest. A full disk: ``DiskFullError`` on every rank, nothing of this step left."""
    shards = ckpt.shards_folder(tr.run_dir, tr.steps_done) if tr.world is not None else None
    try:
        path = _write(tr, shards)
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if shards is not None:  # (once moved into the checkpoint's temporary folder, removed with it)
            shutil.rmtree(shards, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) or not is_disk_full(e):
            raise
        raise checkpoint_full(tr.run_dir, tr.steps_done, checkpoint_bytes(tr), ckpt.latest_checkpoint(tr.run_dir),
                              tr.run_dir) from e
    return path


def _write(tr: Trainer, shards: Path | None) -> Path | None:
    """The write itself: the ranks' parts into ``shards`` (several ranks), then rank 0's checkpoint, whose outcome
    every rank learns (collective where there are several)."""
    optimizers, policy, draft = tr._optimizers(), tr.policy, tr.draft
    if shards is not None:  # every rank writes its part (DCP); rank 0 also gets the whole policy and draft
        save_shards(_parts(tr), shards)  # (a rank whose write fails fails it on every rank)
        optimizers["policy"] = optimizers["draft"] = None
        policy, draft = _whole(tr)
    path = failed = None
    if tr.is_main:
        try:
            with hold_signals():  # a Ctrl-C waits for the write: the step being saved is kept, then it stops
                path = ckpt.save_checkpoint(tr.run_dir, tr.steps_done, policy=policy, draft=draft,
                                            optimizers=optimizers,
                                            state=_checkpoint_state(tr),
                                            config=tr.cfg.to_dict(), keep_last=tr.cfg.log.keep_last,
                                            extra_files=_tokenizer_files(tr.policy_dir), shards=shards)
                tr._saved = tr.steps_done  # (before a held signal is delivered: no second write on the way out)
        except Exception as e:
            failed = e
    if tr.world is not None:  # how rank 0's write went, on every rank: none trains on, or waits, alone
        outcome = None if failed is None else (is_disk_full(failed), (str(failed).splitlines() or [repr(failed)])[0])
        outcome = tr.world.all_gather_object(outcome, f"rank 0's write of the checkpoint of step {tr.steps_done}")[0]
        if outcome is not None and failed is None:
            full, text = outcome
            if full:
                raise OSError(errno.ENOSPC, f"rank 0: {text}")
            raise ckpt.CheckpointError(f"rank 0 could not write the checkpoint of step {tr.steps_done}: {text}")
    if failed is not None:
        raise failed
    tr._saved = tr.steps_done
    return path


def checkpoint_bytes(tr: Trainer) -> int:
    """About how many bytes a checkpoint of this run takes: the whole weights (``policy/``, ``draft.pt``) and two
    AdamW moments per trained weight; a run of several ranks writes its trained weights and their moments in
    ``sharded/`` instead of ``optim.pt``. (The same figure on every rank: from the whole modules.)"""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)
    weights = size(tr.policy.state_dict().values()) + (size(tr.draft.state_dict().values()) if tr.draft is not None
                                                       else 0)
    trained = size(tr.policy.parameters()) + (size(tr.draft.trainable_parameters()) if tr.trains_draft else 0)
    return weights + 2 * trained + (trained if tr.world is not None else 0)


def _draft_here(tr: Trainer) -> bool:
    """This rank trains the draft (every rank does, except the stages before the last)."""
    return tr.trains_draft and (tr.mesh is None or tr.mesh.last)


def _parts(tr: Trainer) -> dict:
    """This rank's part of a checkpoint: name -> (module, its optimiser, the tensor names it holds or None for
    all): the policy (its stage's tensors under pp) and the draft where this rank trains it."""
    held = None
    if tr.mesh is not None and tr.mesh.pp > 1:
        names = {id(p): n for n, p in tr.policy.named_parameters()}
        held = {names[id(p)] for p in tr._owned()[0]}
    parts = {"policy": (tr.policy, tr.opt, held)}
    if _draft_here(tr):
        parts["draft"] = (tr.draft, tr.draft_opt, None)
    return parts


def _whole(tr: Trainer) -> tuple:
    """The policy and draft as one process holds them, on rank 0 (collective: sharded layouts gather)."""
    if tr.layout.sharded_stages:  # (its stages freed the others' tensors: gathered stage by stage, tp or not)
        weights, trained = tr.rollout_weights.refit.whole(tr.policy)
        if not tr.is_main:
            return None, None
        draft = tr.draft if tr.draft is None else {**tr.draft.state_dict(), **trained}
        return plain_policy(tr.policy.config, weights), draft
    if tr.layout.sharded or tr.layout.tp > 1:
        return full_policy(tr.policy), full_state(tr.draft) if tr.trains_draft and tr.layout.sharded else tr.draft
    return tr.policy, tr.draft  # every rank holds them whole (pp: after the weight sync)


def _checkpoint_state(tr: Trainer) -> dict:
    state = {"prompts_used": tr._done_prompts}
    if tr._done_acceptance:  # draft_length=auto: a resume continues the same estimates
        state["acceptance"] = tr._done_acceptance
    return state


def _tokenizer_files(policy_dir: Path) -> dict[str, str]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
             "char_tokenizer.json")
    return {n: (policy_dir / n).read_text() for n in names if (policy_dir / n).is_file()}


def resume_from(tr: Trainer, found) -> None:
    """Continue from checkpoint ``found``: the draft, optimisers and schedulers, the step and prompt
    counters, the acceptance estimates (a "spec_pays" of checkpoints from before draft_length is
    ignored); the rollout engines' copies refreshed (vLLM's pushed and checked). (The policy's weights: loaded
    from ``found`` before the layout was applied.)"""
    optimizers, draft = tr._optimizers(), tr.draft
    sharded = found.path / ckpt.SHARDS
    if sharded.is_dir():  # a run of several ranks: this rank's part, resharded to this layout
        load_shards(_parts(tr), sharded)
    elif tr.world is not None:  # a one-process checkpoint: every rank reads the whole state and keeps its part
        load_full_state(tr.policy, tr.opt, None, found.optim["policy"], [n for n, _ in tr.policy.named_parameters()])
        if _draft_here(tr):
            load_full_state(tr.draft, tr.draft_opt, found.draft, found.optim["draft"],
                            _trained_names(tr.draft))
    if sharded.is_dir() or tr.world is not None:  # done above
        optimizers["policy"] = optimizers["draft"] = None
        if _draft_here(tr):
            draft = None  # (the other stages' whole draft, for their engines: from draft.pt)
    state = ckpt.restore(found, draft=draft, optimizers=optimizers)
    tr.rollout_weights.refresh()  # the engines' draft copies were made from the draft before this
    if tr.vllm is not None:  # rollout.backend=vllm: the checkpoint's weights into vLLM, checked
        tr.vllm.refit(tr.draft)
        tr.vllm.check(f"resume from {found.path}")
    tr.start_step, tr.prompts_used = state["step"], state["prompts_used"]
    estimates = tr._estimates()  # (log.frozen_probe_every may have changed: no frozen probe now)
    for name, saved in state.get("acceptance", {}).items():
        if name in estimates:
            estimates[name].load_state_dict(saved)
    _follow_schedule(tr.sched)  # `steps` may have changed on resume: the lr is the cosine's


def _trained_names(draft) -> list[str]:
    """The draft's trained parameters' names, in the order of a one-process optimiser's indices."""
    names = {id(p): n for n, p in draft.named_parameters()}
    return [names[id(p)] for p in draft.trainable_parameters()]


def _follow_schedule(sched):
    """Set the optimiser's lr to the scheduler's own function of the restored step (LambdaLR's
    formula): the same value when nothing changed, the new cosine's when `steps` did."""
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]
