"""Where freetoken keeps what it builds, and the error a model that cannot be found raises.

A leaf: it imports nothing of freetoken's, so that any layer (the kernels, the loader, the
server's launch) can use it without importing another.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where built kernels, converted GGUF folders and kernel probes are kept."""
    return Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))


class ModelNotFound(RuntimeError):
    """A one-line, user-facing reason the model could not be found or loaded."""
