"""A stand-in for distributed.group.Group where a test loads one tensor-parallel rank alone."""

from __future__ import annotations

import torch


class OneRank:
    """distributed.group.Group's interface for one rank loaded alone (no forward runs)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no collective runs at load")

    gather = sum
