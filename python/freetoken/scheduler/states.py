"""The scheduler's side of a hybrid model's recurrent states: one pool slot per running request,
and prefix-cache snapshots at chunk boundaries.

A cached KV prefix is of no use to a linear-attention layer without its state at the prefix's
end, so the cache matches only up to its deepest node holding a snapshot. Snapshots are taken
while prompts are prefilled, at positions that are multiples of the delta rule's chunk
(kvcache/state_pool.py's CHUNK): the chunked form then resumes from one with the arithmetic of a prefill
that ran through it. Prefill chunks are cut on those boundaries for the same reason.

The pool holds `max_running_requests` request slots plus `snapshots` snapshot slots. A request
that finds no free slot takes the least recently used snapshot's; so does a new snapshot. When
the KV pool evicts a trie leaf, the leaf's snapshot goes with it.
"""

from __future__ import annotations

from freetoken.core import Batch, Req
from freetoken.kvcache.state_pool import CHUNK, StatePool
from freetoken.scheduler.cache import LeastRecentlyUsed, PrefixCache, _Node


class SnapshotCache(PrefixCache):
    """PrefixCache whose matches end at a node holding a recurrent-state snapshot."""

    def __init__(self, kv, pool: StatePool):
        super().__init__(kv)
        self.pool = pool
        self.snapshots = 0
        self._held = LeastRecentlyUsed(lambda n: n.parent is not None and n.snapshot is not None)

    def _usable(self, path: list[_Node]) -> int:
        return max((i + 1 for i, node in enumerate(path) if node.snapshot is not None), default=0)

    def insert(self, ids: list[int], slots: list[int]) -> None:
        """A prompt's KV is kept only with the snapshots taken along it (`add_snapshot`)."""

    def add_snapshot(self, ids: list[int], slots: list[int], snapshot: int) -> None:
        super().insert(ids, slots)
        node = self._node(ids)
        if node.snapshot is None:
            node.snapshot = snapshot
            self.snapshots += 1
            self._held.push(node)
        else:  # another request with this prefix got there first
            self.pool.release(snapshot)

    def snapshot_of(self, ids: list[int]) -> int | None:
        return self._node(ids).snapshot

    def evict_snapshot(self, keep: int | None = None) -> bool:
        """Drop the least recently used snapshot (but `keep`); False if there is none."""
        node = self._held.pop(lambda n: n.snapshot != keep)
        if node is None:
            return False
        self._drop_snapshot(node)
        return True

    def _touch(self, path: list[_Node]) -> None:
        super()._touch(path)
        for node in path:
            if node.snapshot is not None:
                self._held.push(node)

    def _node(self, ids: list[int]) -> _Node:
        node = self.root
        for token in ids:
            node = node.children[token]
        return node

    def _drop_snapshot(self, node: _Node) -> None:
        self.pool.release(node.snapshot)
        node.snapshot = None
        self.snapshots -= 1

    def _remove(self, leaf: _Node) -> None:
        if leaf.snapshot is not None:
            self._drop_snapshot(leaf)
        super()._remove(leaf)


class RecurrentStates:
    def __init__(self, pool: StatePool, cache: SnapshotCache | None):
        self.pool, self.cache = pool, cache

    def _allocate(self, keep: int | None = None) -> int | None:
        slot = self.pool.allocate()
        while slot is None and self.cache is not None and self.cache.evict_snapshot(keep):
            slot = self.pool.allocate()
        return slot

    def admit(self, req: Req, hit: int) -> None:
        """Give an admitted request its slot, holding the snapshot of its cached prefix if any."""
        snapshot = self.cache.snapshot_of(req.all_ids[:hit]) if hit else None
        req.state_slot = self._allocate(keep=snapshot)
        # max_running_requests slots are never snapshots' (they are taken back first).
        assert req.state_slot is not None, "recurrent-state pool smaller than the running requests"
        if snapshot is not None:
            self.pool.copy(snapshot, req.state_slot)

    def chunk_size(self, done: int, size: int, left: int) -> int:
        """A prefill chunk that stops short of the prompt's end is cut on a chunk boundary: the
        last one the budget reaches, else the next one (up to CHUNK - 1 tokens past the budget).
        Every chunk then starts on a boundary and does a one-shot prefill's arithmetic, bit for
        bit; a start mid-chunk would be front-padded, exact only mathematically."""
        if size >= left:
            return size
        end = (done + size) // CHUNK * CHUNK
        return min(end - done if end > done else CHUNK - done % CHUNK, left)

    def plan_snapshots(self, req: Req, done: int, n: int) -> None:
        """Snapshot slots for the prompt's boundaries that tokens [done, done + n) reach."""
        if self.cache is None:
            return
        last = min(done + n, len(req.prompt_ids))
        for pos in range((done // CHUNK + 1) * CHUNK, last + 1, CHUNK):
            slot = self._allocate()
            if slot is None:
                break
            req.snapshots[pos] = slot

    def after_step(self, batch: Batch) -> None:
        for req in batch.reqs:
            for pos, slot in req.snapshots.items():
                self.cache.add_snapshot(req.all_ids[:pos], req.slots[:pos], slot)
            req.snapshots = {}

    def release(self, req: Req) -> None:
        for slot in req.snapshots.values():
            self.pool.release(slot)
        req.snapshots = {}
        if req.state_slot is not None:
            self.pool.release(req.state_slot)
            req.state_slot = None

    def stats(self) -> dict[str, int]:
        return {"state_slots_free": self.pool.num_free, "state_slots_total": self.pool.num_slots,
                "state_snapshots": self.cache.snapshots if self.cache is not None else 0,
                "state_bytes_per_slot": self.pool.slot_bytes}
