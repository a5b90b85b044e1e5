"""pool_attention.c against a float64 softmax written here; a row batched vs alone, one thread vs
two, the AVX2 path vs the AVX-512 one."""

import pytest
import torch
from freetoken.kernels import pool_attention

pytestmark = pytest.mark.skipif(pool_attention.load() is None, reason="no pool attention kernel here")


def reference(q, cache, keys, sink=None):
    """Float64 attention of q [heads, D] over the cache rows `keys`."""
    heads, dim = q.shape
    kvh = cache.shape[1] // 2
    kv = cache[keys].double()
    k, v = kv[:, :kvh].repeat_interleave(heads // kvh, 1), kv[:, kvh:].repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) / dim**0.5
    if sink is not None:
        scores = torch.cat([scores, sink.double()[:, None]], dim=1)
    weights = scores.softmax(-1)[:, : len(keys)]
    return torch.einsum("hn,nhd->hd", weights, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (16, 2, 72), (12, 2, 80)])
def test_matches_float64_reference_and_batch(dtype, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim)
    cache = torch.randn(1200, 2 * kv_heads, dim, generator=gen).mul(2).to(dtype)
    lengths = [1, 7, 100, 1000]
    slots = [torch.randperm(1200, generator=gen)[:n] for n in lengths]
    table = torch.cat(slots)
    firsts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    # The last row sees a window: its keys 900..999 only.
    ranges = torch.stack([firsts, torch.tensor([0, 0, 0, 900]), torch.tensor([1, 7, 100, 1000])], 1)
    q = torch.randn(len(lengths), heads, dim, generator=gen).mul(2).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    threads = torch.get_num_threads()
    for sink in (None, sinks):
        batched = pool_attention.attend(q, cache, table, ranges, sink)
        torch.set_num_threads(1 if threads > 1 else 2)
        try:  # the 1,000-key row makes the call parallel where there are threads
            assert torch.equal(pool_attention.attend(q, cache, table, ranges, sink), batched)
        finally:
            torch.set_num_threads(threads)
        for r, n in enumerate(lengths):
            lo = int(ranges[r, 1])
            want = reference(q[r].float(), cache, slots[r][lo:], sink)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(batched[r].double(), want, atol=tol, rtol=tol)
            alone = pool_attention.attend(q[r : r + 1], cache, slots[r],
                                          torch.tensor([[0, lo, n]]), sink)
            assert torch.equal(alone[0], batched[r])
        lib = pool_attention.load()
        best = lib.pool_attention_set_isa(1)
        try:
            assert torch.equal(pool_attention.attend(q, cache, table, ranges, sink), batched)
        finally:
            lib.pool_attention_set_isa(best)
