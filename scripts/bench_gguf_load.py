"""Loading a real-size GGUF with its blocks kept quantized: load seconds and resident memory
against the file's size.

The model is synthetic: Qwen3-8B's shapes (36 layers, hidden 4096, 32 heads / 8 KV heads of 128,
intermediate 12288), or with --shape qwen3-30b-a3b Qwen3-30B-A3B's (48 layers, hidden 2048, 32
heads / 4 KV heads of 128, 128 experts of 768, 8 active), on the default model's tokenizer and
49152-token vocabulary, in the formats llama.cpp's Q4_K_M gives a model (Q4_K; attn_v and
ffn_down / ffn_down_exps in Q6_K on the layers its `use_more_bits` picks; the head in Q6_K);
or with --shape gpt-oss-20b gpt-oss-20b's as its released GGUF stores it (24 layers, hidden
2880, 64 heads / 8 KV heads of 64 with sinks and biases, a 128-token window on every other
layer, 32 experts of 2880, 4 active, MXFP4 with F32 biases; embedding, attention and head in
Q8_0; the vocabulary padded to its 201088 tokens), random blocks with small finite scales (one random draw per tensor shape and format, reused by
every layer: the file is written at the disk's speed). It is written once under the cache (or
--path; streamed, tensor by tensor), then each measurement runs in a fresh process:
FREETOKEN_GGUF_WEIGHTS=quantized (load seconds, VmRSS / VmHWM after the load and after one
8-token forward, which reads every weight) and float32 (refused by the memory check where the
dequantised weights do not fit, both sizes named). --serve: `freetoken serve` on the file
instead, one chat and one scoring request, the server's start seconds and resident memory, then
--clients chats of 16 tokens at once: their aggregate tokens a second and the server's peak
resident memory (each of its processes' VmHWM, summed: at most what they held together), and the
same of llama.cpp's llama-server (--llama-server BIN, one slot per client) on the same file.

    python scripts/bench_gguf_load.py               # ~4.6 GB file
    python scripts/bench_gguf_load.py --layers 8 --weights quantized   # a smaller one
    python scripts/bench_gguf_load.py --no-forward  # the load alone
    python scripts/bench_gguf_load.py --shape qwen3-30b-a3b --path /tmp/a3b.gguf --serve  # ~17 GB
    python scripts/bench_gguf_load.py --shape gpt-oss-20b --weights quantized   # ~12 GB
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402

SHAPES = {"qwen3-8b": dict(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288),
          "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                                experts=128, experts_used=8, expert_intermediate=768),
          "gpt-oss-20b": dict(layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, intermediate=2880,
                              experts=32, experts_used=4, expert_intermediate=2880, vocab=201088, window=128)}

MEASURE = r"""
import json, sys, time
t0 = time.perf_counter()
from freetoken.config import WeightsConfig
from freetoken.models.registry import load_model
from freetoken.paths import ModelNotFound
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "VmHWM")}
try:
    loaded = load_model(sys.argv[1], dtype="float32", device="cpu", kv_slots=4096, weights=WeightsConfig(gguf_weights=sys.argv[2]))
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


def qwen3_tensors(layers: int, shape: dict, vocab: int) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, dims, format) of a Qwen3 (MoE) model in llama.cpp's Q4_K_M mix."""
    import gguf

    h, inter, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    experts, moe = shape.get("experts", 0), shape.get("expert_intermediate", 0)
    q4k, q6k, f32 = (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K,
                     gguf.GGMLQuantizationType.F32)
    tensors: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (vocab, h), q4k)]
    for i in range(layers):
        v_down = q6k if use_more_bits(i, layers) else q4k
        tensors += [(f"blk.{i}.attn_norm.weight", (h,), f32), (f"blk.{i}.ffn_norm.weight", (h,), f32),
                    (f"blk.{i}.attn_q_norm.weight", (d,), f32), (f"blk.{i}.attn_k_norm.weight", (d,), f32),
                    (f"blk.{i}.attn_q.weight", (shape["heads"] * d, h), q4k),
                    (f"blk.{i}.attn_k.weight", (shape["kv_heads"] * d, h), q4k),
                    (f"blk.{i}.attn_v.weight", (shape["kv_heads"] * d, h), v_down),
                    (f"blk.{i}.attn_output.weight", (h, shape["heads"] * d), q4k)]
        if experts:
            tensors += [(f"blk.{i}.ffn_gate_inp.weight", (experts, h), f32),
                        (f"blk.{i}.ffn_gate_exps.weight", (experts, moe, h), q4k),
                        (f"blk.{i}.ffn_up_exps.weight", (experts, moe, h), q4k),
                        (f"blk.{i}.ffn_down_exps.weight", (experts, h, moe), v_down)]
        else:
            tensors += [(f"blk.{i}.ffn_gate.weight", (inter, h), q4k),
                        (f"blk.{i}.ffn_up.weight", (inter, h), q4k),
                        (f"blk.{i}.ffn_down.weight", (h, inter), v_down)]
    return tensors + [("output_norm.weight", (h,), f32), ("output.weight", (vocab, h), q6k)]


def gpt_oss_tensors(layers: int, shape: dict, vocab: int) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, dims, format) of a gpt-oss model as its released GGUF stores one."""
    import gguf

    h, d, e, inter = shape["hidden"], shape["head_dim"], shape["experts"], shape["expert_intermediate"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    q8, mxfp4, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4,
                      gguf.GGMLQuantizationType.F32)
    tensors: list[tuple[str, tuple[int, ...], object]] = [("token_embd.weight", (vocab, h), q8)]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (h,), f32), (f"blk.{i}.post_attention_norm.weight", (h,), f32),
                    (f"blk.{i}.attn_sinks.weight", (shape["heads"],), f32)]
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            tensors += [(f"blk.{i}.{name}.weight", (rows, cols), q8), (f"blk.{i}.{name}.bias", (rows,), f32)]
        tensors += [(f"blk.{i}.ffn_gate_inp.weight", (e, h), f32), (f"blk.{i}.ffn_gate_inp.bias", (e,), f32)]
        for name, rows, cols in (("ffn_gate_exps", inter, h), ("ffn_up_exps", inter, h), ("ffn_down_exps", h, inter)):
            tensors += [(f"blk.{i}.{name}.weight", (e, rows, cols), mxfp4), (f"blk.{i}.{name}.bias", (e, rows), f32)]
    return tensors + [("output_norm.weight", (h,), f32), ("output.weight", (vocab, h), q8)]


def write_model(path: Path, layers: int, shape: dict) -> None:
    import gguf
    import numpy as np

    source = gguf.GGUFReader(bc.default_gguf())
    vocab = shape.get("vocab") or len(source.fields["tokenizer.ggml.tokens"].data)
    h, d, experts = shape["hidden"], shape["head_dim"], shape.get("experts", 0)
    gpt_oss = "window" in shape
    tensors = (gpt_oss_tensors if gpt_oss else qwen3_tensors)(layers, shape, vocab)
    writer = gguf.GGUFWriter(str(path), "gpt-oss" if gpt_oss else "qwen3moe" if experts else "qwen3")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(150000.0 if gpt_oss else 1e6)
    writer.add_layer_norm_rms_eps(1e-5 if gpt_oss else 1e-6)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(shape["experts_used"])
        writer.add_expert_feed_forward_length(shape["expert_intermediate"])
    if gpt_oss:  # gpt-oss-20b's: YaRN x32 over 4096 positions
        writer.add_sliding_window(shape["window"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            value = field.contents()
            if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and len(value) < vocab:
                # padded as llama.cpp's converter pads a vocabulary to the embedding's rows
                pad = [f"[PAD{i}]" for i in range(len(value), vocab)] if name.endswith("tokens") else (
                    [gguf.TokenType.UNUSED] * (vocab - len(value)))
                value = [*value, *pad]
            writer.add_key_value(name, value, field.types[0], sub)
    for name, dims, kind in tensors:
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[kind]
            stored = (*dims[:-1], dims[-1] // block * size)
            writer.add_tensor_info(name, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    drawn: dict[tuple, np.ndarray] = {}
    for name, dims, kind in tensors:
        if (dims, kind) not in drawn:
            drawn[dims, kind] = _random_tensor(rng, dims, kind)
        writer.write_tensor_data(drawn[dims, kind])
    writer.close()


def _random_tensor(rng, dims: tuple[int, ...], kind) -> object:
    """F32: ones (norms) or small random values (a router, so that routes differ); a block
    format: random quants, small finite fp16 scales."""
    import gguf
    import numpy as np

    formats = gguf.GGMLQuantizationType
    if kind == formats.F32:
        return np.ones(dims, np.float32) if len(dims) == 1 else rng.standard_normal(dims).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (*dims[:-1], dims[-1] // block, size), dtype=np.uint8)
    if kind == formats.MXFP4:  # its E8M0 scale byte first: 2^-10
        data[..., 0] = 127 - 10
        return data.reshape(*dims[:-1], -1)
    # Small finite fp16 scales: d (and Q4_K's dmin) at the block's start, Q6_K's d at its end.
    offsets = {formats.Q4_K: [0, 2], formats.Q8_0: [0], formats.Q6_K: [size - 2]}[kind]
    for offset in offsets:
        data[..., offset:offset + 2] = np.array([1e-4], dtype=np.float16).view(np.uint8)
    return data.reshape(*dims[:-1], -1)


SERVE_PROMPT = [{"role": "user", "content": "Name three colours."}]


def serve(path: Path, threads: int, clients: int, llama_server: Path | None) -> None:
    """`freetoken serve` on `path`: seconds to healthy, one chat and one scoring request,
    the server's resident memory (its process group) against the file's size; then `clients`
    chats at once (clients_phase), and the same against `llama_server` (llama.cpp's binary, one
    slot per client) where given."""
    import httpx

    t0 = time.perf_counter()
    with bc.freetoken_server("--model", str(path), "--kv-cache-tokens", "4096", threads=threads) as server:
        ready = time.perf_counter() - t0
        rss_ready = _group_rss(server.proc.pid)
        t1 = time.perf_counter()
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=600, json={
            "messages": SERVE_PROMPT, "max_tokens": 8, "temperature": 0}).json()
        chat_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        scored = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
            "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 2,
            "allowed_token_ids": [100, 200], "return_tokens_as_token_ids": True}).json()
        score_s = time.perf_counter() - t1
        stats = httpx.get(f"{server.url}/v1/stats", timeout=60).json()
        rss_after = _group_rss(server.proc.pid)
        rows = [["freetoken", *clients_phase(server, clients)]]
    weights = (stats.get("engine") or {}).get("weight_bytes", {})
    print(json.dumps({"chat": chat.get("choices", chat), "scoring": scored.get("choices", scored)})[:1500])
    bc.print_table(f"Serving {path.name} (GB; seconds)",
                   ["file", "weights held", "start s", "RSS ready", "chat s (8 tokens)", "scoring s", "RSS after"],
                   [[path.stat().st_size / 2**30, sum(weights.values()) / 2**30, ready, rss_ready,
                     chat_s, score_s, rss_after]])
    if llama_server is not None:
        t0 = time.perf_counter()
        with bc.Server([str(llama_server), "-m", str(path), "-t", str(threads), "-np", str(clients),
                        "-c", str(4096 * clients), "--host", "127.0.0.1", "--port", "{port}"],
                       name="llama-server", timeout=600) as server:
            bc.note(f"llama-server healthy in {time.perf_counter() - t0:.1f} s")
            rows.append(["llama-server", *clients_phase(server, clients)])
    bc.print_table(f"{clients} chats at once, 16 tokens each, {path.name}",
                   ["server", "tokens/s", "peak RSS GB", "peak RSS - file GB"],
                   [[*row, row[-1] - path.stat().st_size / 2**30] for row in rows])


def clients_phase(server: bc.Server, clients: int) -> tuple[float, float]:
    """`clients` chats of 16 tokens at once (EOS ignored): (their tokens a second, the peak
    resident memory of the server's processes, each one's VmHWM summed: at most what they held
    together)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one_chat(i: int) -> int:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=1200, json={
            "messages": [{"role": "user", "content": f"Client {i}: name three colours."}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
        return reply["usage"]["completion_tokens"]

    one_chat(clients)  # warm-up: the first request's one-time costs are not the clients'
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one_chat, range(clients)))
    return tokens / (time.perf_counter() - t0), _group_rss(server.proc.pid, "VmHWM")


def _group_rss(pid: int, field: str = "VmRSS") -> float:
    """GB resident in the processes of `pid`'s process group (the server and its engine), by
    /proc's `field` of each (VmHWM: each one's peak)."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pid:
                continue
            fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
            total += int(fields[field].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            continue
    return total / 2**30


def synthetic_model(shape: str = "qwen3-8b", layers: int | None = None, path: Path | None = None) -> Path:
    """The synthetic model of `shape` (SHAPES) with `layers` decoder layers (default: the shape's):
    at `path`, default under the cache, written there first where absent."""
    from freetoken.paths import cache_root

    layers = layers or SHAPES[shape]["layers"]
    mix = "released" if "window" in SHAPES[shape] else "q4_k_m"
    path = path or cache_root() / "bench-models" / f"{shape}-shape-{mix}-{layers}l.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tmp = path.with_suffix(".tmp")
        write_model(tmp, layers, SHAPES[shape])
        tmp.replace(path)
        print(f"# wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def main() -> None:
    p = bc.base_parser(__doc__.split("\n")[0], repeats=False)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b", help="the model whose shapes to take")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--path", type=Path, default=None, help="where to write the file (default: the cache)")
    p.add_argument("--serve", action="store_true", help="serve the file: one chat, one scoring request")
    p.add_argument("--clients", type=int, default=4, help="--serve: chats at once for the peak resident memory")
    p.add_argument("--llama-server", type=Path, default=None,
                   help="--serve: llama.cpp's llama-server binary, run on the file as well (a slot per client)")
    p.add_argument("--weights", default="quantized,float32", help="FREETOKEN_GGUF_WEIGHTS values to load")
    p.add_argument("--no-forward", action="store_true", help="measure the load only")
    args = p.parse_args()
    bc.setup(args)
    layers = 4 if args.quick else args.layers or SHAPES[args.shape]["layers"]
    path = synthetic_model(args.shape, layers, args.path)
    if args.serve:
        serve(path, args.threads, args.clients, args.llama_server)
        return
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
