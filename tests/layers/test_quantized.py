"""Quantized layers against the gguf package's dequantized weights: a fused layer of parts in
different formats (and a part dequantized at load) with a bias, the embedding's lookup, and
which weights of a state dict go to them."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from freetoken.kernels.quant import QuantizedWeight
from freetoken.kernels.int8 import Int8Parts, arithmetic
from freetoken.layers.quantized import QuantizedEmbedding, QuantizedLinear, take_quantized, weight_bytes
from freetoken.models.llama import FUSED
from tests.fixtures.build_models import random_blocks


def _weight(qtype, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    data = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    values = torch.from_numpy(quants.dequantize(data, qtype).astype(np.float32))
    return QuantizedWeight(qtype, torch.from_numpy(data), (rows, cols)), values


def test_a_fused_layer_of_mixed_parts_is_the_dequantized_product():
    (q, q_ref), (v, v_ref) = _weight(Q.Q4_K, 64, 256, 0), _weight(Q.Q6_K, 32, 256, 1)
    k = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))  # dequantized at load
    bias = torch.randn(128, generator=torch.Generator().manual_seed(3))
    layer = QuantizedLinear([q, k, v], bias)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4))
    expected = torch.nn.functional.linear(x, torch.cat([q_ref, k, v_ref]), bias)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)
    assert (layer.in_features, layer.out_features) == (256, 128)


def test_the_embedding_looks_up_dequantized_rows():
    table, ref = _weight(Q.Q8_0, 50, 64, 5)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(QuantizedEmbedding(table, torch.float32)(ids), ref[ids])
    assert QuantizedEmbedding(table, torch.bfloat16)(ids).dtype == torch.bfloat16


def test_modules_with_a_quantized_part_are_taken_with_all_their_parts():
    w, _ = _weight(Q.Q4_0, 8, 32, 6)
    plain = torch.zeros(8, 32)
    prefix = "model.layers.0."
    state = {f"{prefix}self_attn.q_proj.weight": w, f"{prefix}self_attn.k_proj.weight": plain,
             f"{prefix}self_attn.v_proj.weight": w, f"{prefix}self_attn.q_proj.bias": torch.zeros(8),
             f"{prefix}mlp.gate_proj.weight": plain, f"{prefix}mlp.up_proj.weight": plain,
             f"{prefix}mlp.down_proj.weight": w, "model.embed_tokens.weight": w}
    taken = take_quantized(state, FUSED)
    expected = {f"{prefix}self_attn.qkv_proj": [w, plain, w], f"{prefix}mlp.down_proj": [w],
                "model.embed_tokens": [w]}
    assert taken.keys() == expected.keys()
    assert all(a is b for name in expected for a, b in zip(taken[name], expected[name], strict=True))
    assert set(state) == {f"{prefix}self_attn.q_proj.bias", f"{prefix}mlp.gate_proj.weight",
                          f"{prefix}mlp.up_proj.weight"}


def test_weight_bytes_count_a_shared_weight_once():
    w, _ = _weight(Q.Q8_0, 16, 32, 7)
    model = torch.nn.ModuleDict({"embed": QuantizedEmbedding(w, torch.float32),
                                 "head": QuantizedLinear([w], None),
                                 "norm": torch.nn.LayerNorm(32, bias=False)})
    assert weight_bytes(model) == {"Q8_0": 16 * 34, "float32": 32 * 4}


def test_a_heads_outputs_at_some_columns_keep_the_whole_layers_bits():
    """`logits_at` on the blocks (scoring's labels): those columns alone, as the whole layer
    computes them; None for a layer of several parts."""
    for qtype in (Q.Q8_0, Q.Q4_1, Q.Q4_K):
        head, values = _weight(qtype, 300, 256, 6)
        layer = QuantizedLinear([head], None)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7))
        columns = [0, 7, 8, 150, 299]  # column-tile edges, the last row of the weight
        expected = layer(x)[:, columns]
        got = layer.logits_at(x, columns)
        assert torch.equal(got, expected)
        reference = (x.double() @ values.double().T)[:, columns]  # gguf's dequantized weights
        torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-4)
        assert torch.equal(layer.logits_at(x[2:3], columns), expected[2:3])
    assert QuantizedLinear([head, head], None).logits_at(x, columns) is None


def test_an_int8_heads_columns_keep_the_whole_layers_bits():
    """Under the int8 arithmetic a layer of its formats runs Int8Parts, `logits_at` too (the
    scores of allowed_token_ids equal the whole head's); one with another format's part stays exact."""
    head, _ = _weight(Q.Q6_K, 300, 256, 8)
    with arithmetic("int8"):
        layer, mixed = QuantizedLinear([head], None), QuantizedLinear([head, _weight(Q.Q4_1, 8, 256, 9)[0]], None)
    assert isinstance(layer.fused, Int8Parts) and not isinstance(mixed.fused, Int8Parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(10))
    columns = [0, 7, 8, 150, 299]
    assert torch.equal(layer.logits_at(x, columns), layer(x)[:, columns])
    assert not torch.equal(layer(x), QuantizedLinear([head], None)(x))  # not the exact arithmetic
