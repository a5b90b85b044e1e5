"""A preallocated KV pool addressed by token slots (page size 1, as mini-sglang).

A request owns a list of slots; the prefix cache can hand the same slots to several requests,
so slots are reference-counted and return to the free list only when nobody holds them. The
cache's own reference is marked (`cache_hold`), so that `num_used` counts the slots some request
holds: a slot only the cache holds is evictable, and counts as free for the usage metric (as
vLLM's `kv_cache_usage_perc`), though not on the free list.
"""

from __future__ import annotations

import math

import torch


def token_row(cfg) -> tuple[int, int]:
    """A token's entry in one layer of the pool: the model config's own `kv_row` where it has one
    (MLA's: the compressed latent and the rope key, layers/mla.py), else its K heads then
    its V heads, [2 * kv heads, head_dim]."""
    return getattr(cfg, "kv_row", None) or (2 * cfg.num_kv_heads, cfg.head_dim)


def pool_bytes(cfg, num_layers: int, num_slots: int, dtype: torch.dtype) -> int:
    """What a pool of `num_slots` tokens over `num_layers` layers of `cfg` holds."""
    return num_layers * math.prod(token_row(cfg)) * num_slots * dtype.itemsize


class KVPool:
    def __init__(self, num_slots: int, num_layers: int, row: tuple[int, int], dtype: torch.dtype,
                 device: torch.device):
        """`row`: a token's entry in a layer (`token_row`)."""
        # One extra row past the last slot: padding tokens write their K/V there.
        self.scratch_slot = num_slots
        # A slot holds a token's whole entry (K heads then V heads): one write and one gather a layer.
        shape = (num_slots + 1, *row)
        # empty, not zeros: a slot is always written before it is read, and untouched pages
        # of a large pool then cost no memory.
        self.kv = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for cache in self.kv:
            # Padded attention reads the scratch slot under a mask: it must hold no NaN/inf.
            cache[self.scratch_slot].zero_()
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._refs = [0] * num_slots
        self._cached = bytearray(num_slots)  # 1 where the prefix cache holds a reference
        self.num_used = 0  # slots that some request holds

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, slot: int) -> int:
        return self._refs[slot]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV pool exhausted: {n} slots asked, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        for s in slots:
            self._refs[s] = 1
        self.num_used += n
        return slots

    def retain(self, slots: list[int]) -> None:
        for s in slots:
            if self._refs[s] == self._cached[s]:  # no request held it
                self.num_used += 1
            self._refs[s] += 1

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self._refs[s] -= 1
            if self._refs[s] == self._cached[s]:  # the last request let go of it
                self.num_used -= 1
            if self._refs[s] == 0:
                self._free.append(s)

    def cache_hold(self, slots: list[int]) -> None:
        """The prefix cache's reference on each of `slots` (one at most), which `num_used`
        leaves out."""
        refs, cached = self._refs, self._cached
        for s in slots:
            cached[s] = 1
            refs[s] += 1

    def cache_drop(self, slot: int) -> None:
        self._cached[slot] = 0
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._free.append(slot)
