"""Prefix cache: a token trie whose nodes own KV slots (radix cache with page size 1).

The cache holds one reference on every slot it stores; a request that reuses a prefix takes
one more. Eviction removes least-recently-used leaves whose slot nobody else holds, so KV in
use is never evicted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from freetoken.engine.kv_pool import KVPool


@dataclass(eq=False)
class _Node:
    slot: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    snapshot: int | None = None  # hybrid models: state slot at this prefix (scheduler/states.py)


class PrefixCache:
    def __init__(self, kv: KVPool):
        self.kv = kv
        self.root = _Node(slot=-1, parent=None)
        self._clock = itertools.count(1)

    def match(self, ids: list[int]) -> tuple[list[int], int]:
        """Retain and return the slots of the longest cached prefix of `ids`.

        The last token is never matched: its forward must run to produce the next logits.
        """
        node, slots, now = self.root, [], next(self._clock)
        for token in ids[:-1]:
            node = node.children.get(token)
            if node is None:
                break
            node.last_used = now
            slots.append(node.slot)
        self.kv.retain(slots)
        return slots, len(slots)

    def insert(self, ids: list[int], slots: list[int]) -> None:
        node, now = self.root, next(self._clock)
        for token, slot in zip(ids, slots):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(slot=slot, parent=node)
                self.kv.cache_hold(slot)
            child.last_used = now
            node = child

    def evict(self, n: int) -> int:
        """Free up to `n` slots; returns how many were freed."""
        freed = 0
        while freed < n:
            leaves = [x for x in self._nodes() if not x.children and self.kv.refs(x.slot) == 1]
            if not leaves:
                break
            leaves.sort(key=lambda x: x.last_used)
            for leaf in leaves[: n - freed]:
                self._remove(leaf)
                freed += 1
        return freed

    def _remove(self, leaf: _Node) -> None:
        del leaf.parent.children[next(t for t, c in leaf.parent.children.items() if c is leaf)]
        self.kv.cache_drop(leaf.slot)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node
