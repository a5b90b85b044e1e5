"""Upstream FreeToken's module names, kept for its users and the seed scripts: the code lives in
`freetoken.serving` (and `freetoken.parsing`)."""

from freetoken.serving.launch.serve import launch_server

__all__ = ["launch_server"]
