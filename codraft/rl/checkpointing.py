"""The trainer's checkpoints (``codraft.train.checkpoint`` writes and reads them): ``save`` writes the last
completed step, ``resume_from`` continues from one.

Only rank 0 writes, one consolidated checkpoint (under pp every rank holds every weight; the stages'
optimiser states are gathered); under dp every rank also writes its shards of the policy and its
optimiser (``sharded/``, torch.distributed.checkpoint), which a resume at any layout reshards; a Ctrl-C
during the write waits for it. A checkpoint carries the draft, optimisers and schedulers, the prompt
counter and, with draft_length=auto, the running acceptance estimates, so a resumed run repeats an
uninterrupted one's rollouts and updates.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from codraft.parallel.data_parallel import full_policy, full_state, load_full_state, load_shards, save_shards
from codraft.rl.pipelined import ConsolidatedState, keep_state
from codraft.rl.update_phase import hold_ctrl_c
from codraft.train import checkpoint as ckpt

if TYPE_CHECKING:
    from codraft.rl.trainer import Trainer


def save(tr: Trainer) -> Path | None:
    """Checkpoint the last completed step (`steps_done`); only rank 0 writes, one consolidated
    checkpoint (under pp every rank holds every weight; the stages' optimiser states are gathered)."""
    optimizers, policy = tr._optimizers(), tr.policy
    if tr.mesh is not None and tr.mesh.pp > 1:
        own, drafts = tr._owned()
        optimizers.update(policy=ConsolidatedState(tr.opt, own, tr.world),
                          draft=tr.draft_opt and ConsolidatedState(tr.draft_opt, drafts, tr.world))
    shards, draft = None, tr.draft
    if tr.layout.sharded:  # every rank writes its shards (DCP); rank 0 also gathers the whole policy and draft
        shards = ckpt.shards_folder(tr.run_dir, tr.steps_done)
        save_shards(_sharded(tr), shards)
        policy, optimizers["policy"] = full_policy(tr.policy), None
        if tr.trains_draft:
            draft, optimizers["draft"] = full_state(tr.draft), None
    if not tr.is_main:
        tr._saved = tr.steps_done
        return None
    with hold_ctrl_c():  # a Ctrl-C waits for the write: the step being saved is kept, then it stops
        path = ckpt.save_checkpoint(tr.run_dir, tr.steps_done, policy=policy, draft=draft,
                                    optimizers=optimizers,
                                    state=_checkpoint_state(tr),
                                    config=tr.cfg.to_dict(), keep_last=tr.cfg.log.keep_last,
                                    extra_files=_tokenizer_files(tr.policy_dir), shards=shards)
        tr._saved = tr.steps_done
    return path


def _sharded(tr: Trainer) -> dict:
    """What a data-parallel checkpoint holds as shards: the policy and the co-trained draft, with their
    optimisers."""
    parts = {"policy": (tr.policy, tr.opt)}
    if tr.trains_draft:
        parts["draft"] = (tr.draft, tr.draft_opt)
    return parts


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
    ignored)."""
    optimizers, draft = tr._optimizers(), tr.draft
    sharded = found.path / ckpt.SHARDS
    if sharded.is_dir():  # a data-parallel run's: resharded to this layout (any dp, or whole tensors)
        load_shards(_sharded(tr), sharded)
    elif tr.layout.sharded:  # a one-process checkpoint: every rank reads the whole state and keeps its shards
        load_full_state(tr.policy, tr.opt, None, found.optim["policy"])  # (the weights: loaded before sharding)
        if tr.trains_draft:
            load_full_state(tr.draft, tr.draft_opt, found.draft, found.optim["draft"])
    if sharded.is_dir() or tr.layout.sharded:  # done above
        optimizers["policy"] = None
        if tr.trains_draft:
            optimizers["draft"], draft = None, None
    state = ckpt.restore(found, draft=draft, optimizers=optimizers)
    tr.rollout_weights.refresh()  # the engines' draft copies were made from the draft before this
    tr.start_step, tr.prompts_used = state["step"], state["prompts_used"]
    estimates = tr._estimates()  # (log.frozen_probe_every may have changed: no frozen probe now)
    for name, saved in state.get("acceptance", {}).items():
        if name in estimates:
            estimates[name].load_state_dict(saved)
    _follow_schedule(tr.sched)  # `steps` may have changed on resume: the lr is the cosine's
    if tr.mesh is not None and tr.mesh.pp > 1:  # a stage keeps the optimiser state of what it trains only
        own, drafts = tr._owned()
        keep_state(tr.opt, own)
        keep_state(tr.draft_opt, drafts)


def _follow_schedule(sched):
    """Set the optimiser's lr to the scheduler's own function of the restored step (LambdaLR's
    formula): the same value when nothing changed, the new cosine's when `steps` did."""
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]
