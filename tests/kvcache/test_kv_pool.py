"""KV pool accounting: `num_used` counts slots a request holds, not those only the cache holds."""

from __future__ import annotations

import torch

from freetoken.kvcache.kv_pool import KVPool


def test_num_used_leaves_out_slots_only_the_cache_holds():
    kv = KVPool(8, num_layers=1, row=(2, 2), dtype=torch.float32,
                device=torch.device("cpu"))
    a = kv.allocate(3)
    kv.cache_hold(a)  # the cache keeps the prompt's KV
    assert kv.num_used == 3 and kv.num_free == 5
    kv.retain(a[:2])  # a second request reuses two of them
    kv.release(a)  # the first request ends: the cache and the second request still hold slots
    assert kv.num_used == 2 and kv.num_free == 5
    kv.release(a[:2])
    assert kv.num_used == 0 and kv.num_free == 5  # cached, evictable, not on the free list
    kv.retain(a[2:])  # a cache hit on a slot nobody else holds makes it used again
    assert kv.num_used == 1
    kv.release(a[2:])
    for s in a:
        kv.cache_drop(s)
    assert kv.num_used == 0 and kv.num_free == 8
