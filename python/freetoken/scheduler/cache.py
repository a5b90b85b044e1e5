"""Prefix cache: a token trie whose nodes own KV slots (radix cache with page size 1).

The cache holds one reference on every slot it stores; a request that reuses a prefix takes
one more. Eviction removes least-recently-used leaves whose slot nobody else holds, so KV in
use is never evicted.

Leaves wait in a heap ordered by last use. A touched node is pushed again rather than moved,
so entries go stale; a stale one (the node was touched since, gained a child or left the trie)
is dropped when it surfaces, and all of them once they outnumber the current ones. An evicted
node then costs O(log n), plus one pop per leaf still held by a running request; a leaf's
parent that the leaf's removal leaves childless, last used with it, is the next leaf the heap
would give, so it goes at once without the round trip (a prompt's tokens leave as a chain).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from freetoken.kvcache.kv_pool import KVPool


@dataclass(eq=False, slots=True)
class _Node:
    slot: int
    parent: _Node | None
    token: int = -1  # its key in the parent's children
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    snapshot: int | None = None  # hybrid models: state slot at this prefix (scheduler/states.py)


class LeastRecentlyUsed:
    """Trie nodes by last use, oldest first, with stale entries skipped when they surface."""

    def __init__(self, live: Callable[[_Node], bool]):
        self.live = live
        self._heap: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()
        self._kept = 0

    def push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_used, next(self._order), node))
        if len(self._heap) > 2 * self._kept + 64:
            self._drop_stale()

    def _current(self, entry) -> bool:
        stamp, _, node = entry
        return stamp == node.last_used and self.live(node)

    def _drop_stale(self) -> None:
        """Amortised O(1) a push: it runs after at least `_kept` + 64 pushes since the last."""
        seen, kept = set(), []
        for entry in self._heap:
            if self._current(entry) and id(entry[2]) not in seen:
                seen.add(id(entry[2]))
                kept.append(entry)
        heapq.heapify(kept)
        self._heap, self._kept = kept, len(kept)

    def pop(self, usable: Callable[[_Node], bool]) -> _Node | None:
        """The least recently used live node that is `usable` now. Live nodes passed over are
        pushed back, so a leaf a request holds is a candidate again once it lets go."""
        passed, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._current(entry):
                continue
            if usable(entry[2]):
                found = entry[2]
                break
            passed.append(entry)
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found


def _in_trie(node: _Node) -> bool:
    return node.parent is not None


class PrefixCache:
    def __init__(self, kv: KVPool):
        self.kv = kv
        self.root = _Node(slot=-1, parent=None)
        self._clock = itertools.count(1)
        self._leaves = LeastRecentlyUsed(lambda n: _in_trie(n) and not n.children)

    def match(self, ids: list[int]) -> tuple[list[int], int]:
        """Retain and return the slots of the longest cached prefix of `ids`.

        The last token is never matched: its forward must run to produce the next logits.
        """
        path = self._path(ids[:-1])
        path = path[: self._usable(path)]
        self._touch(path)
        slots = [node.slot for node in path]
        self.kv.retain(slots)
        return slots, len(slots)

    def insert(self, ids: list[int], slots: list[int]) -> None:
        path = self._path(ids)
        node, known = path[-1] if path else self.root, len(path)
        for token, slot in zip(ids[known:], slots[known:]):
            child = node.children[token] = _Node(slot, node, token)
            path.append(child)
            node = child
        self.kv.cache_hold(slots[known : len(path)])
        self._touch(path)

    def evict(self, n: int) -> int:
        """Free up to `n` slots; returns how many were freed."""
        freed = 0
        while freed < n:
            leaf = self._leaves.pop(self._unheld)
            if leaf is None:
                break
            stamp = leaf.last_used
            while True:  # up the chain of nodes last used with the leaf (the module's docstring)
                parent = leaf.parent
                self._remove(leaf)
                freed += 1
                if parent is self.root or parent.children:
                    break
                if freed == n or parent.last_used != stamp or not self._unheld(parent):
                    self._leaves.push(parent)
                    break
                leaf = parent
        return freed

    def _unheld(self, node: _Node) -> bool:
        """Held by the cache alone: no request reads its slot."""
        return self.kv.refs(node.slot) == 1

    def _path(self, ids: list[int]) -> list[_Node]:
        node, path = self.root, []
        for token in ids:
            node = node.children.get(token)
            if node is None:
                break
            path.append(node)
        return path

    def _usable(self, path: list[_Node]) -> int:
        """How much of a matched path a request may reuse."""
        return len(path)

    def _touch(self, path: list[_Node]) -> None:
        now = next(self._clock)
        for node in path:
            node.last_used = now
        if path and not path[-1].children:
            self._leaves.push(path[-1])

    def _remove(self, leaf: _Node) -> None:
        """Out of the trie; its parent, if that leaves it a leaf, is `evict`'s to queue."""
        del leaf.parent.children[leaf.token]
        leaf.parent = None
        self.kv.cache_drop(leaf.slot)
