"""Where freetoken keeps what it builds, the memory this process may still take, and the error
a model that cannot be found raises.

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


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, or less where a cgroup limits it."""
    amounts = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                amounts.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            amounts.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(amounts) if amounts else None
