"""Helpers shared by the benchmark scripts (bench_engine, bench_server, bench_scoring).

Every figure these scripts print is measured in the run that prints it; baselines (HF
transformers on the same weights, the offline API, llama.cpp's server) run in the same process
or on the same machine in the same run, and results are shown as ratios, never as pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import freetoken  # noqa: F401  (before torch: the OpenMP wait the package sets, as a server has it)
import torch

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Plain English words to build deterministic, distinct prompts of a chosen token length.
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing about rain "
    "river mountain garden coffee engine window paper market doctor teacher student "
    "silver yellow happy quiet early late broken fresh ancient modern simple careful "
    "walks builds carries opens closes finds writes reads sells paints counts watches "
    "under behind across between beside during after before because although until"
).split()


# ----------------------------------------------------------------------------- arguments


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (None means "depends on --quick")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def base_parser(description: str, repeats: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=_Help)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="torch threads, for our engine and for HF alike (servers get OMP_NUM_THREADS)")
    p.add_argument("--http-client", choices=HTTP_CLIENTS, default="raw",
                   help="load generator: raw keep-alive HTTP/1.1 (~0.2 ms CPU a request) or httpx")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    if repeats:
        p.add_argument("--repeats", type=int, default=None,
                       help="timed repeats per figure (the best is kept); default 3, 1 with --quick")
    return p


def setup(args: argparse.Namespace) -> None:
    # SIGTERM unwinds like Ctrl-C, so the servers' context managers stop their process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(args.threads)
    global http_client
    http_client = args.http_client
    repeats = hasattr(args, "repeats")
    if repeats and args.repeats is None:
        args.repeats = 1 if args.quick else 3
    omp = os.environ.get("OMP_WAIT_POLICY")
    # The cores this process may run on (its affinity, as torch's default thread count), not the machine's.
    print(f"# machine: {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, {args.threads} threads"
          + (f", OMP_WAIT_POLICY={omp}" if omp else "")
          + (f"; best of {args.repeats} repeat(s)" if repeats else "; each level runs once"),
          flush=True)
    load_note()


def load_note() -> None:
    """The 1/5/15-minute load averages: this machine is shared, and they say how busy it was."""
    if hasattr(os, "getloadavg"):
        print("# load average now: " + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)


def parse_dtypes(value: str) -> list[str]:
    dtypes = [d.strip() for d in value.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"unknown dtype(s) {bad}; use float32 and/or bfloat16")
    return dtypes


# ----------------------------------------------------------------------------- models, prompts


def model_folder() -> Path:
    """An HF folder of the default model's weights as transformers reads them (the GGUF's
    float32 conversion: the blocks dequantized, as our loader reads them by default)."""
    from freetoken.models.loader import weights_folder
    from freetoken.models.registry import model_folder as folder_of

    return weights_folder(folder_of(None)[0])


def default_gguf() -> Path:
    from freetoken.models.files import default_model_path

    return default_model_path()


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder())


def load_hf(dtype: str, folder: Path | None = None):
    """HF transformers on the very weights our engine loads (the default model's, or those in
    `folder`); returns (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder or model_folder(), dtype=DTYPES[dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder) if folder else load_tokenizer()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def param_counts(hf_model) -> tuple[int, int]:
    """(body, head): matmul weights per token excluding the embedding lookup, and the LM head."""
    head = hf_model.get_output_embeddings().weight
    embed = hf_model.get_input_embeddings().weight
    body = sum(p.numel() for p in hf_model.parameters()
               if p.data_ptr() not in (head.data_ptr(), embed.data_ptr()))
    return body, head.numel()


def text_of_tokens(tokenizer, n_tokens: int, rng: random.Random, prefix: str = "") -> str:
    """A distinct string of about `n_tokens` tokens (exact when re-encoded, up to merges)."""
    words = [prefix] if prefix else []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words.append(rng.choice(WORDS))
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def token_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct token-id prompts of exactly `length` tokens, from real text."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        ids = tokenizer.encode(text_of_tokens(tokenizer, length + 4, rng, f"Note {i}:"),
                               add_special_tokens=False)
        out.append(ids[:length])
    return out


# ----------------------------------------------------------------------------- timing


def best_time(fn: Callable[[], Any], repeats: int, min_seconds: float = 0.0) -> float:
    """Seconds of the fastest of `repeats` calls, or of as many more as fill `min_seconds`
    (other processes only ever slow a run down)."""
    best, start, count = float("inf"), time.perf_counter(), 0
    while count < repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        count += 1
    return best


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def gemm_roofline(dtype: str, seconds: float = 1.0) -> dict[str, float]:
    """Peak GEMM GFLOP/s on this machine, measured now on the model's own shapes.

    The shapes are the MLP/attention projections of a ~1000-token prefill of the default model
    (M tokens x K hidden -> N). The kernels: `torch.mm` (MKL for float32 on a CPU build, oneDNN
    for bfloat16) and each candidate of layers/linear.py that runs here, called in one piece
    (no row rule); each gets the best of its shapes.
    """
    from freetoken.layers.linear import CANDIDATES, Linear, prepare

    shapes = [(1024, 576, 1536), (1024, 1536, 576), (2048, 576, 1536), (1024, 576, 576)]
    best: dict[str, float] = {}
    for m, k, n in shapes:
        a = torch.randn(m, k).to(DTYPES[dtype])
        b = torch.randn(k, n).to(DTYPES[dtype])
        layer = Linear(k, n, bias=False).to(DTYPES[dtype]).requires_grad_(False)
        kernels = {"torch.mm": lambda: torch.mm(a, b)}
        for name in CANDIDATES[:1] + CANDIDATES[2:]:  # "torch" is torch.mm's F.linear
            if (run := prepare(name, layer)) is not None:
                kernels[name] = lambda run=run: run(a)
        for kernel, run in kernels.items():
            run()  # warm-up
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / len(shapes) / len(kernels):
                run()
                count += 1
            rate = 2 * m * k * n * count / (time.perf_counter() - t0) / 1e9
            best[kernel] = max(best.get(kernel, 0.0), rate)
    return best


def kernel_heading(loaded) -> None:
    """The CPU and the kernel each linear layer kind of `loaded` (a LoadedModel) runs on."""
    from freetoken.layers.kernel_choice import cpu_name

    plan = loaded.model.kernel_plan
    claim = "batch-invariant" if plan.invariant else "NOT batch-invariant"
    print(f"# cpu: {cpu_name()}; linear kernels ({claim}):",
          "; ".join(f"{kind}: {kernel}" for kind, kernel in plan.kernels.items()), flush=True)


# ----------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server in a subprocess (its own process group) on a free port, healthy on return.

    Used as a context manager; on exit the whole process group is terminated, so the engine
    process of `freetoken serve` never outlives the benchmark.
    """

    def __init__(self, cmd: list[str], health: str = "/health", threads: int | None = None,
                 name: str = "server", timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([c.replace("{port}", str(self.port)) for c in cmd], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # the engine process shares the group; make sure nothing of ours is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def freetoken_server(*flags: str, threads: int | None = None, name: str = "freetoken") -> Server:
    return Server([sys.executable, "-m", "freetoken", "serve", *flags, "--port", "{port}"],
                  threads=threads, name=name)


def llama_cpp_server(gguf: Path, threads: int = 2) -> Server | None:
    """llama-cpp-python's OpenAI server on the same GGUF, or None when it is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    return Server([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                   "--n_threads", str(threads), "--host", "127.0.0.1", "--port", "{port}"],
                  health="/v1/models", name="llama.cpp")


LLAMA_CPP_MISSING = ("llama.cpp server: not installed "
                     "(pip install llama-cpp-python[server] builds from source, ~5 min)")


# ----------------------------------------------------------------------------- HTTP load


@dataclass
class LoadResult:
    n: int
    wall_s: float
    latencies: list[float]
    responses: list[dict] = field(repr=False)
    client_cpu_s: float = 0.0

    @property
    def client_cpu_ms(self) -> float:
        """The load generator's own CPU per request: on a machine it shares with the server."""
        return 1e3 * self.client_cpu_s / self.n

    @property
    def rps(self) -> float:
        return self.n / self.wall_s

    @property
    def p50(self) -> float:
        return percentile(self.latencies, 50)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 99)

    def usage_sum(self, key: str) -> int:
        return sum(r.get("usage", {}).get(key) or 0 for r in self.responses)

    def cached_tokens(self) -> int:
        return sum((r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                   for r in self.responses)


class _Connection:
    """One keep-alive HTTP/1.1 connection that POSTs pre-encoded JSON bodies.

    The load runs on the machine it measures (2 cores here): httpx's AsyncClient spends about
    2 ms of CPU a request, taken from the server under test, where this spends a tenth of it.
    `--http-client httpx` measures with httpx instead.
    """

    def __init__(self, host: str, port: int, path: str, timeout: float):
        self.host, self.port, self.path, self.timeout = host, port, path, timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode() + body)
        return await asyncio.wait_for(self._response(), self.timeout)

    async def _response(self) -> tuple[int, bytes]:
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        if "content-length" not in headers:
            raise RuntimeError(f"HTTP {status} without Content-Length: {headers}")
        body = await self.reader.readexactly(int(headers["content-length"]))
        if headers.get("connection") == "close":
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _raw_client(url: str, timeout: float):
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = _Connection(parts.hostname, parts.port or 80, parts.path, timeout)

    async def post(payload: dict) -> dict:
        status, body = await conn.post(json.dumps(payload).encode())
        if status != 200:
            raise RuntimeError(f"HTTP {status} from {url}: {body[:500]!r}")
        return json.loads(body)
    return post, conn.close


def _httpx_client(client, url: str):
    async def post(payload: dict) -> dict:
        r = await client.post(url, json=payload)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} from {url}: {r.text[:500]}")
        return r.json()
    return post


HTTP_CLIENTS = ("raw", "httpx")
http_client = "raw"  # set by setup() from --http-client


async def _run_load(url: str, payloads: list[dict], concurrency: int, timeout: float) -> LoadResult:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(payloads)):
        queue.put_nowait(i)
    latencies: list[float] = [0.0] * len(payloads)
    responses: list[dict] = [{}] * len(payloads)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            if http_client == "raw":
                post, close = _raw_client(url, timeout)
            else:
                post, close = _httpx_client(client, url), None
            try:
                while not queue.empty():
                    i = queue.get_nowait()
                    t0 = time.perf_counter()
                    responses[i] = await post(payloads[i])
                    latencies[i] = time.perf_counter() - t0
            finally:
                if close is not None:
                    await close()

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return LoadResult(len(payloads), wall, latencies, responses, cpu)


def run_load(url: str, payloads: list[dict], concurrency: int, timeout: float = 600) -> LoadResult:
    """POST every payload to `url` from `concurrency` clients (each sends its next request as
    soon as its previous one is answered); latency is per request, wall time for the lot, and
    the CPU time this process spent sending and reading them."""
    return asyncio.run(_run_load(url, payloads, concurrency, timeout))


# ----------------------------------------------------------------------------- output


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:,.{digits}f}"
    return str(value)


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """A Markdown table (so it can be pasted into benchmarks/results/ as printed)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    print(f"\n### {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                                for c, w in zip(r, widths)) + " |")
    sys.stdout.flush()


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-") and cell != "-"


def note(text: str) -> None:
    print(text, flush=True)
