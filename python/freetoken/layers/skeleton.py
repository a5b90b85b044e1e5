"""Modules built as skeletons: meta tensors, no initial values.

A loader builds a model's modules on the meta device and then assigns the checkpoint's tensors.
torch's initialisers (`nn.Linear`'s uniform, `nn.Embedding`'s normal) still run there, and on
meta tensors they go through torch's Python references, whose first call imports torch._dynamo:
seconds of every model load, for values nothing reads.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn import init

_INITIALISERS = [name for name in dir(init) if name.endswith("_") and not name.startswith("_")]


def _leave(tensor, *args, **kwargs):
    return tensor


@contextmanager
def on_meta():
    """Within it, modules are built on the meta device with their initialisers skipped."""
    saved = {name: getattr(init, name) for name in _INITIALISERS}
    for name in saved:
        setattr(init, name, _leave)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, initialiser in saved.items():
            setattr(init, name, initialiser)
