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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from codraft.config import RunConfig
from codraft.parallel.comm import Group
from codraft.parallel.data_parallel import full_policy, full_state, load_full_state, load_shards, plain_policy, \
    save_shards
from codraft.parallel.mesh import Mesh
from codraft.rl.interrupt import hold_signals
from codraft.rl.update_phase import Learner
from codraft.train import checkpoint as ckpt
from codraft.train.disk_full import checkpoint_full, is_disk_full


@dataclass
class Checkpoints:
    """What save and resume read: the run (its config, folder, the policy's source folder for the tokenizer
    files), this rank's place (``world``, ``mesh``: None in one process) and the trained state (``Learner``)."""
    cfg: RunConfig
    run_dir: Path
    policy_dir: Path
    world: Group | None
    mesh: Mesh | None
    learner: Learner

    @property
    def is_main(self) -> bool:
        return self.world is None or self.world.rank == 0


def save(c: Checkpoints, step: int, state: dict, saved: Callable[[], None]) -> Path | None:
    """Checkpoint completed step ``step`` with the trainer's ``state`` (prompts used, acceptance estimates):
    every rank's part (several ranks), then rank 0 writes the consolidated rest; ``saved()`` runs once it is
    written (on rank 0, before a signal held during the write is delivered). A full disk: ``DiskFullError`` on
    every rank, nothing of this step left."""
    shards = ckpt.shards_folder(c.run_dir, step) if c.world is not None else None
    try:
        path = _write(c, step, state, saved, shards)
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if shards is not None:  # (once moved into the checkpoint's temporary folder, removed with it)
            shutil.rmtree(shards, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) or not is_disk_full(e):
            raise
        raise checkpoint_full(c.run_dir, step, checkpoint_bytes(c.learner, several=c.world is not None),
                              ckpt.latest_checkpoint(c.run_dir), c.run_dir) from e
    saved()
    return path


def _write(c: Checkpoints, step: int, state: dict, saved: Callable[[], None], shards: Path | None) -> Path | None:
    """The write itself: the ranks' parts into ``shards`` (several ranks), then rank 0's checkpoint, whose outcome
    every rank learns (collective where there are several)."""
    lr = c.learner
    optimizers, policy, draft = lr.optimisers.as_dict(), lr.policy, lr.draft
    if shards is not None:  # every rank writes its part (DCP); rank 0 also gets the whole policy and draft
        save_shards(_parts(c), shards)  # (a rank whose write fails fails it on every rank)
        optimizers["policy"] = optimizers["draft"] = None
        policy, draft = _whole(c)
    path = failed = None
    if c.is_main:
        try:
            with hold_signals():  # a Ctrl-C waits for the write: the step being saved is kept, then it stops
                path = ckpt.save_checkpoint(c.run_dir, step, policy=policy, draft=draft, optimizers=optimizers,
                                            state=state, config=c.cfg.to_dict(), keep_last=c.cfg.log.keep_last,
                                            extra_files=_tokenizer_files(c.policy_dir), shards=shards)
                saved()  # (before a held signal is delivered: no second write on the way out)
        except Exception as e:
            failed = e
    if c.world is not None:  # how rank 0's write went, on every rank: none trains on, or waits, alone
        outcome = None if failed is None else (is_disk_full(failed), (str(failed).splitlines() or [repr(failed)])[0])
        outcome = c.world.all_gather_object(outcome, f"rank 0's write of the checkpoint of step {step}")[0]
        if outcome is not None and failed is None:
            full, text = outcome
            if full:
                raise OSError(errno.ENOSPC, f"rank 0: {text}")
            raise ckpt.CheckpointError(f"rank 0 could not write the checkpoint of step {step}: {text}")
    if failed is not None:
        raise failed
    return path


def checkpoint_bytes(lr: Learner, several: bool) -> int:
    """About how many bytes a checkpoint of this run takes: the whole weights (``policy/``, ``draft.pt``) and two
    AdamW moments per trained weight; a run of ``several`` ranks writes its trained weights and their moments in
    ``sharded/`` instead of ``optim.pt``. (The same figure on every rank: from the whole modules.)"""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)
    weights = size(lr.policy.state_dict().values()) + (size(lr.draft.state_dict().values()) if lr.draft is not None
                                                       else 0)
    trained = size(lr.policy.parameters()) + (size(lr.draft.trainable_parameters()) if lr.trains_draft else 0)
    return weights + 2 * trained + (trained if several else 0)


def _draft_here(c: Checkpoints) -> bool:
    """This rank trains the draft (every rank does, except the stages before the last)."""
    return c.learner.trains_draft and (c.mesh is None or c.mesh.last)


def _parts(c: Checkpoints) -> dict:
    """This rank's part of a checkpoint: name -> (module, its optimiser, the tensor names it holds or None for
    all): the policy (its stage's tensors under pp) and the draft where this rank trains it."""
    lr, held = c.learner, None
    if c.mesh is not None and c.mesh.pp > 1:
        names = {id(p): n for n, p in lr.policy.named_parameters()}
        held = {names[id(p)] for p in lr.step.owned()[0]}
    parts = {"policy": (lr.policy, lr.optimisers.policy, held)}
    if _draft_here(c):
        parts["draft"] = (lr.draft, lr.optimisers.draft, None)
    return parts


def _whole(c: Checkpoints) -> tuple:
    """The policy and draft as one process holds them, on rank 0 (collective: sharded layouts gather)."""
    lr, layout = c.learner, c.mesh.layout
    if layout.sharded_stages:  # (its stages freed the others' tensors: gathered stage by stage, tp or not)
        weights, trained = lr.rollout_weights.refit.whole(lr.policy)
        if not c.is_main:
            return None, None
        draft = lr.draft if lr.draft is None else {**lr.draft.state_dict(), **trained}
        return plain_policy(lr.policy.config, weights), draft
    if layout.sharded or layout.tp > 1:
        return full_policy(lr.policy), full_state(lr.draft) if lr.trains_draft and layout.sharded else lr.draft
    return lr.policy, lr.draft  # every rank holds them whole (pp: after the weight sync)


def _tokenizer_files(policy_dir: Path) -> dict[str, str]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
             "char_tokenizer.json")
    return {n: (policy_dir / n).read_text() for n in names if (policy_dir / n).is_file()}


def resume_from(c: Checkpoints, found) -> dict:
    """Continue from checkpoint ``found``: the draft, optimisers and schedulers restored, the rollout engines'
    copies refreshed (vLLM's pushed and checked). Returns the trainer's state (``step``, ``prompts_used``,
    ``acceptance``: the estimates with draft_length=auto). (The policy's weights: loaded from ``found`` before the
    layout was applied.)"""
    lr = c.learner
    optimizers, draft = lr.optimisers.as_dict(), lr.draft
    sharded = found.path / ckpt.SHARDS
    if sharded.is_dir():  # a run of several ranks: this rank's part, resharded to this layout
        load_shards(_parts(c), sharded)
    elif c.world is not None:  # a one-process checkpoint: every rank reads the whole state and keeps its part
        load_full_state(lr.policy, lr.optimisers.policy, None, found.optim["policy"],
                        [n for n, _ in lr.policy.named_parameters()])
        if _draft_here(c):
            load_full_state(lr.draft, lr.optimisers.draft, found.draft, found.optim["draft"], _trained_names(lr.draft))
    if sharded.is_dir() or c.world is not None:  # done above
        optimizers["policy"] = optimizers["draft"] = None
        if _draft_here(c):
            draft = None  # (the other stages' whole draft, for their engines: from draft.pt)
    state = ckpt.restore(found, draft=draft, optimizers=optimizers)
    lr.rollout_weights.refresh()  # the engines' draft copies were made from the draft before this
    if lr.vllm is not None:  # rollout.backend=vllm: the checkpoint's weights into vLLM, checked
        lr.vllm.refit(lr.draft)
        lr.vllm.check(f"resume from {found.path}")
    _follow_schedule(lr.optimisers.policy_sched)  # `steps` may have changed on resume: the lr is the cosine's
    return state


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
