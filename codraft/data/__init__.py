"""Your data as a task: ``data.train`` / ``data.val`` files read with their values as written (``files``: JSON
with ``json``, the other formats with Hugging Face ``datasets``) and served through the ``Task`` interface
the built-in generators have (``file_task``), so the trainer has one prompt stream, one position in it
(checkpointed) and one scoring path for both (docs/your-data.md).
"""
from codraft.data.file_task import DataProblem, FileTask, load_file_task
from codraft.data.files import DataError, read_rows
from codraft.tasks import Task, make_task


def build_task(cfg, tok, context: int) -> Task:
    """The run's task: the rows of ``data.train`` (rendered with ``tok``, checked against the policy's
    ``context``), or else the built-in generator ``task.name``."""
    if not cfg.data.train:
        return make_task(cfg.task.name, max_chars=cfg.task.max_chars, format_reward=cfg.task.format_reward)
    return load_file_task(cfg.data, tok, context=context, max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed)


__all__ = ["DataError", "DataProblem", "FileTask", "build_task", "load_file_task", "read_rows"]
