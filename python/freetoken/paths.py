"""Where freetoken keeps what it builds, and the error a model that cannot be found raises.

It imports only freetoken.envs (a leaf), so that any layer (the kernels, the loader, the
server's launch) can use it without importing another.
"""

from __future__ import annotations

from pathlib import Path

from freetoken import envs


def cache_root() -> Path:
    """Where built kernels, converted GGUF folders and kernel probes are kept."""
    return Path(envs.CACHE.get() or Path.home() / ".cache" / "freetoken")


class ModelNotFound(RuntimeError):
    """A one-line, user-facing reason the model could not be found or loaded."""
