"""Where codraft caches what it builds once: converted SmolLM2, the tiny warm start, offline
drafts, compiled kernels. ``$CODRAFT_CACHE`` (unset or empty: ``~/.cache/codraft``)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("CODRAFT_CACHE") or Path.home() / ".cache" / "codraft")
