"""Loading a real-size GGUF with its blocks kept quantized: load seconds and resident memory
against the file's size.

The model is synthetic: Qwen3-8B's shapes (36 layers, hidden 4096, 32 heads / 8 KV heads of 128,
intermediate 12288) on the default model's tokenizer and 49152-token vocabulary, in the formats
llama.cpp's Q4_K_M gives a model (Q4_K; attn_v and ffn_down in Q6_K on the layers its
`use_more_bits` picks; the head in Q6_K), random blocks with small finite scales. It is written
once under the cache (streamed, tensor by tensor), then each measurement runs in a fresh
process: FREETOKEN_GGUF_WEIGHTS=quantized (load seconds, VmRSS / VmHWM after the load and after
one 8-token forward, which reads every weight) and float32 (refused by the memory check where
the dequantised weights do not fit, both sizes named).

    python scripts/bench_gguf_load.py               # ~4.6 GB file
    python scripts/bench_gguf_load.py --layers 8 --weights quantized   # a smaller one
    python scripts/bench_gguf_load.py --no-forward  # the load alone
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

SHAPE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288)

MEASURE = r"""
import json, sys, time
t0 = time.perf_counter()
from freetoken.models.registry import load_model
from freetoken.paths import ModelNotFound
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}
try:
    loaded = load_model(sys.argv[1], dtype="float32", device="cpu", kv_slots=4096, gguf_weights=sys.argv[2])
except ModelNotFound as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit()
out = {"load_s": time.perf_counter() - t0, "after_load": status(),
       "weight_gb": sum(loaded.model.weight_bytes.values()) / 2**30}
if sys.argv[3] == "0":
    print(json.dumps(out))
    sys.exit()
from freetoken.scheduler.factory import build_scheduler
from freetoken.core import SamplingParams
from freetoken.message import UserMsg
scheduler = build_scheduler(loaded, kv_slots=4096)
scheduler.add(UserMsg(0, list(range(100, 108)), SamplingParams(temperature=0, max_tokens=1)))
t1 = time.perf_counter()
while scheduler.has_work:
    scheduler.step()
out |= {"forward_s": time.perf_counter() - t1, "after_forward": status()}
print(json.dumps(out))
"""


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_model(path: Path, layers: int) -> None:
    import gguf
    import numpy as np

    source = gguf.GGUFReader(bc.default_gguf())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    h, inter, d = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["head_dim"]
    q4k, q6k, f32 = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K,
                     gguf.GGMLQuantizationType.F32)
    tensors: list[tuple[str, tuple[int, int] | int, object]] = [("token_embd.weight", (vocab, h), q4k)]
    for i in range(layers):
        v_down = q6k if use_more_bits(i, layers) else q4k
        tensors += [(f"blk.{i}.attn_norm.weight", h, f32), (f"blk.{i}.ffn_norm.weight", h, f32),
                    (f"blk.{i}.attn_q_norm.weight", d, f32), (f"blk.{i}.attn_k_norm.weight", d, f32),
                    (f"blk.{i}.attn_q.weight", (SHAPE["heads"] * d, h), q4k),
                    (f"blk.{i}.attn_k.weight", (SHAPE["kv_heads"] * d, h), q4k),
                    (f"blk.{i}.attn_v.weight", (SHAPE["kv_heads"] * d, h), v_down),
                    (f"blk.{i}.attn_output.weight", (h, SHAPE["heads"] * d), q4k),
                    (f"blk.{i}.ffn_gate.weight", (inter, h), q4k), (f"blk.{i}.ffn_up.weight", (inter, h), q4k),
                    (f"blk.{i}.ffn_down.weight", (h, inter), v_down)]
    tensors += [("output_norm.weight", h, f32), ("output.weight", (vocab, h), q6k)]

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    for name, shape, kind in tensors:
        if kind == f32:
            writer.add_tensor_info(name, (shape,), np.dtype(np.float32), shape * 4)
        else:
            rows, cols = shape
            block, size = gguf.GGML_QUANT_SIZES[kind]
            writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8),
                                   rows * cols // block * size, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, kind in tensors:
        if kind == f32:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        rows, cols = shape
        block, size = gguf.GGML_QUANT_SIZES[kind]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        # Small finite fp16 scales: d (and Q4_K's dmin) at the block's start, Q6_K's d at its end.
        fields = [0, 2] if kind == q4k else [size - 2]
        for offset in fields:
            data[:, :, offset:offset + 2] = np.array([1e-4], dtype=np.float16).view(np.uint8)
        writer.write_tensor_data(data.reshape(rows, -1))
    writer.close()


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0], repeats=False)
    p.add_argument("--layers", type=int, default=36, help="decoder layers (Qwen3-8B: 36)")
    p.add_argument("--weights", default="quantized,float32", help="FREETOKEN_GGUF_WEIGHTS values to load")
    p.add_argument("--no-forward", action="store_true", help="measure the load only")
    args = p.parse_args()
    bc.setup(args)
    from freetoken.paths import cache_root

    layers = 4 if args.quick else args.layers
    path = cache_root() / "bench-models" / f"qwen3-8b-shape-q4_k_m-{layers}l.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tmp = path.with_suffix(".tmp")
        write_model(tmp, layers)
        tmp.replace(path)
        print(f"# wrote {path} in {time.perf_counter() - t0:.0f} s")
    size_gb = path.stat().st_size / 2**30
    rows = []
    for weights in args.weights.split(","):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(path), weights,
                               "0" if args.no_forward else "1"], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:])
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if "refused" in result:
            bc.note(f"{weights}: refused: {result['refused']}")
            continue
        last = result.get("after_forward", result["after_load"])
        rows.append([weights, size_gb, result["weight_gb"], result["load_s"],
                     result["after_load"]["VmRSS"], result.get("forward_s"),
                     result.get("after_forward", {}).get("VmRSS"), last["VmHWM"]])
    bc.print_table(f"Loading {path.name} (GB; seconds)",
                   ["weights", "file", "weights held", "load s", "RSS after load", "8-token forward s",
                    "RSS after forward", "peak RSS"], rows)


if __name__ == "__main__":
    main()
