"""Prefix-cache eviction without a model: least recently used first, held slots kept, and the
work per evicted node independent of the trie's size (counted, not timed)."""

from __future__ import annotations

import torch

from freetoken.kvcache.kv_pool import KVPool
from freetoken.kvcache.state_pool import StatePool, StateShape
from freetoken.scheduler.cache import PrefixCache
from freetoken.scheduler.states import SnapshotCache


def _pool(slots: int) -> KVPool:
    return KVPool(slots, num_layers=1, row=(2, 1), dtype=torch.float32,
                  device=torch.device("cpu"))


def _hit(cache: PrefixCache, ids: list[int]) -> int:
    """A request that matches `ids` and finishes at once: the touch without the hold."""
    slots, hit = cache.match(ids)
    cache.kv.release(slots)
    return hit


def _cached(cache: PrefixCache, ids: list[int]) -> list[int]:
    """Store `ids` the way a finished request does: allocate, insert, let go."""
    slots = cache.kv.allocate(len(ids))
    cache.insert(ids, slots)
    cache.kv.release(slots)
    return slots


def test_evicts_least_recently_used_leaves_first():
    kv = _pool(64)
    cache = PrefixCache(kv)
    _cached(cache, [1, 2, 3])
    _cached(cache, [1, 2, 4])
    _cached(cache, [5, 6])
    assert _hit(cache, [1, 2, 3, 9]) == 3  # [1, 2, 3] becomes the most recent
    assert cache.evict(1) == 1
    assert _hit(cache, [1, 2, 4, 9]) == 2  # [1, 2, 4] was the oldest leaf: 4 went
    assert cache.evict(2) == 2  # then [5, 6], from its leaf up
    assert _hit(cache, [5, 6, 9]) == 0
    assert _hit(cache, [1, 2, 3, 9]) == 3


def test_slots_a_request_holds_are_never_evicted_and_become_evictable_when_released():
    kv = _pool(64)
    cache = PrefixCache(kv)
    _cached(cache, [1, 2, 3])
    _cached(cache, [7, 8])
    held, hit = cache.match([1, 2, 3, 4])
    assert hit == 3
    assert cache.evict(10) == 2  # only [7, 8]
    assert kv.num_free == 64 - 3
    kv.release(held)
    assert cache.evict(10) == 3
    assert kv.num_free == 64


def test_work_per_evicted_node_does_not_grow_with_the_trie():
    """Counted as the leaves whose holders eviction asks the pool about: a scan of the trie
    would ask about each of its leaves."""
    for branches in (50, 800):
        kv = _pool(branches * 4 + 8)
        cache = PrefixCache(kv)
        for b in range(branches):
            _cached(cache, [0, 1000 + b, 2000 + b, 3000 + b])
            _hit(cache, [0, 1000 + b, 2000 + b, 3000 + b, 9])  # a stale entry each
        asked = 0
        refs = kv.refs

        def counting_refs(slot):
            nonlocal asked
            asked += 1
            return refs(slot)

        kv.refs = counting_refs
        assert cache.evict(30) == 30
        assert asked == 30, (branches, asked)


def test_snapshots_go_least_recently_used_first_but_the_kept_one():
    pool = StatePool(4, StateShape(layers=1, conv=(1, 1), recurrent=(1, 1, 1)), torch.float32,
                     torch.device("cpu"))
    kv = _pool(64)
    cache = SnapshotCache(kv, pool)
    snapshots = {}
    for first in (1, 2, 3):
        ids = [first, 10, 11]
        slots = kv.allocate(len(ids))
        snapshots[first] = pool.allocate()
        cache.add_snapshot(ids, slots, snapshots[first])
        kv.release(slots)
    assert _hit(cache, [1, 10, 11, 9]) == 3  # 1 is now the most recent; 2 the oldest
    assert cache.evict_snapshot(keep=snapshots[2])
    assert cache.snapshot_of([3, 10, 11]) is None  # 2 was kept, so 3 went
    assert cache.evict_snapshot()
    assert cache.snapshot_of([2, 10, 11]) is None
    assert cache.snapshot_of([1, 10, 11]) == snapshots[1]
    assert pool.num_free == 3
