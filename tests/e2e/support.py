"""Helpers for end-to-end tests: a real `freetoken serve` subprocess, the scripted models' closed
form, and readers for SSE streams and logprob entries."""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # A killed test run must not leave servers behind (Linux: PR_SET_PDEATHSIG = 1).
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    # Should the suite ever run out of memory, the kernel kills a server (its tests fail) rather
    # than a pytest-xdist worker, after which the run hangs instead of failing. Inherited by the
    # engine processes.
    Path("/proc/self/oom_score_adj").write_text("500")


class Server:
    def __init__(self, *args: str, new_session: bool = False):
        # new_session: its own process group, so a test can send the group a terminal's Ctrl-C.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken", "serve", *args, "--port", str(self.port)],
            # A file, not a pipe: nobody reads a pipe while the server runs, and a full one
            # would block the server.
            env=env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            start_new_session=new_session,
        )
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=300)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def output(self) -> str:
        """What the server has written to stdout and stderr so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


class ServerPool:
    """The servers the e2e modules of one test worker share, started on first use.

    Every server the suite shares kept up at once (two workers, each with its own) outgrows
    CI's 24 GB, so once a module is done its servers are idle and only the `keep` most recently
    used idle ones stay up; the rest stop when the next module starts. Test files run one at a
    time per worker (`--dist loadfile`), so a module never loses a server it is using.
    """

    def __init__(self, keep: int):
        self.keep = keep
        self._servers: dict[tuple[str, ...], Server] = {}  # least recently used first
        self._in_use: set[tuple[str, ...]] = set()

    def enter_module(self) -> None:
        self._in_use = set()
        self._stop_idle(self.keep)

    def get(self, *args: str) -> Server:
        server = self._servers.pop(args, None)
        if server is None or server.proc.poll() is not None:  # a dead one is replaced
            self._stop_idle(self.keep)
            server = Server(*args)
        self._servers[args] = server
        self._in_use.add(args)
        return server

    def close(self) -> None:
        self._in_use = set()
        self._stop_idle(0)

    def _stop_idle(self, keep: int) -> None:
        idle = [args for args in self._servers if args not in self._in_use]
        for args in idle[: max(0, len(idle) - keep)]:
            self._servers.pop(args).stop()


def children(pid: int) -> list[int]:
    """Pids of the live processes whose parent is `pid`."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid) and not fields.get("State", "").startswith("Z"):
            out.append(int(status.parent.name))
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits until none of `pids` runs, or `timeout`; returns those still running."""
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: vocabulary character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]  # shifted to 256, 257, ...
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_OF = _byte_of_char()
_CHAR_OF = {b: c for c, b in _BYTE_OF.items()}


def token_bytes(tok, token_id: int) -> bytes:
    """A byte-level BPE token's raw bytes, read from the vocabulary (not from the server)."""
    piece = tok.convert_ids_to_tokens(token_id)
    if token_id in tok.added_tokens_decoder:
        return piece.encode()
    return bytes(_BYTE_OF[c] for c in piece)


def byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of `text`, so its characters are split across tokens."""
    return [tok.convert_tokens_to_ids(_CHAR_OF[b]) for b in text.encode()]


def positions(tok, ids: list[int], text: str, start: str = "") -> list[int]:
    """Indices of the tokens of `ids` whose bytes overlap the first `text` after `start`."""
    raw = [token_bytes(tok, i) for i in ids]
    joined = b"".join(raw)
    lo = joined.index(text.encode(), joined.index(start.encode()) + len(start.encode()))
    hi, out, at = lo + len(text.encode()), [], 0
    for j, piece in enumerate(raw):
        if at < hi and at + len(piece) > lo:
            out.append(j)
        at += len(piece)
    return out


@dataclass(frozen=True)
class ClosedForm:
    """ScriptedForCausalLM's logits, from its config.json numbers only: at a position whose
    scripted token is t, t gets A, each alternative i != t its a_i, every other id the base b."""

    A: float
    alts: dict[int, float]
    base: float
    V: int

    @classmethod
    def of(cls, folder) -> ClosedForm:
        c = json.loads((Path(folder) / "config.json").read_text())
        alts = {int(i): float(a) for i, a in c["alternatives"]}
        return cls(float(c["scripted_logit"]), alts, float(c["base_logit"]), int(c["vocab_size"]))

    def named(self, t: int) -> list[tuple[int, float]]:
        """(id, logit) of the ids above the base, highest first."""
        named = {**{i: a for i, a in self.alts.items() if i != t}, t: self.A}
        return sorted(named.items(), key=lambda x: -x[1])

    def logit(self, t: int, token: int) -> float:
        return dict(self.named(t)).get(token, self.base)

    def log_z(self, t: int) -> float:
        named = self.named(t)
        rest = (self.V - len(named)) * math.exp(self.base)
        return math.log(sum(math.exp(a) for _, a in named) + rest)

    def logprob(self, t: int, token: int) -> float:
        return self.logit(t, token) - self.log_z(t)

    def top(self, t: int, k: int) -> list[tuple[int, float]]:
        """The top k (id, logprob); k may not reach into the tie of base ids."""
        named = self.named(t)
        assert k <= len(named), "the top k would include an arbitrary base id"
        return [(i, a - self.log_z(t)) for i, a in named[:k]]

    def entry(self, t: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
        """(id, logprob, top k) of a position that sampled its scripted token t."""
        return t, self.logprob(t, t), self.top(t, k)


def as_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def chat_triples(entries: list[dict]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Chat logprob entries (requested with return_tokens_as_token_ids) as ClosedForm.entry."""
    return [(as_id(e["token"]), e["logprob"],
             [(as_id(t["token"]), t["logprob"]) for t in e["top_logprobs"]]) for e in entries]


def assert_entries(actual: list[tuple], expected: list[tuple], tol: float = 1e-4) -> None:
    """Same ids, in order, and every logprob within `tol`: the server's fp32 log-softmax over
    the 248,320 Qwen ids is off by about 6e-5 from the float64 closed form."""
    ids = [(t, [i for i, _ in top]) for t, _, top in actual]
    assert ids == [(t, [i for i, _ in top]) for t, _, top in expected]
    values = [v for _, lp, top in actual for v in (lp, *(x for _, x in top))]
    assert values == pytest.approx([v for _, lp, top in expected for v in (lp, *(x for _, x in top))],
                                   abs=tol)


def sse(server: Server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed request, [DONE] excluded."""
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def assert_completion_stream_joins(events: list[dict], choice: dict) -> None:
    """Streamed /v1/completions chunks join to the non-streamed choice: text and logprobs."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ev in events:
        for c in ev["choices"]:
            for key in joined:
                joined[key] += (c["logprobs"] or {}).get(key, [])
    assert joined == choice["logprobs"]
    assert "".join(c["text"] for ev in events for c in ev["choices"]) == choice["text"]


def merge_chat_stream(events: list[dict]) -> dict:
    """Streamed chat chunks folded into one choice: message text, calls, logprob lists."""
    content, reasoning, calls = "", "", {}
    logprobs, reasoning_logprobs, finish = [], [], []
    for ev in events:
        for c in ev["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["name"] = tc["function"].get("name") or call["name"]
                call["arguments"] += tc["function"].get("arguments") or ""
            logprobs += (c.get("logprobs") or {}).get("content") or []
            reasoning_logprobs += (c.get("reasoning_logprobs") or {}).get("content") or []
            if c["finish_reason"] is not None:
                finish.append(c["finish_reason"])
    assert len(finish) == 1, finish
    return {"content": content, "reasoning": reasoning,
            "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)],
            "call_ids": [calls[i]["id"] for i in sorted(calls)], "finish_reason": finish[0],
            "logprobs": logprobs, "reasoning_logprobs": reasoning_logprobs}


def chat_view(choice: dict) -> dict:
    """A non-streamed chat choice (dict) in merge_chat_stream's shape."""
    msg = choice["message"]
    return {"content": msg.get("content") or "", "reasoning": msg.get("reasoning_content") or "",
            "calls": [(c["function"]["name"], c["function"]["arguments"])
                      for c in msg.get("tool_calls") or []],
            "call_ids": [c["id"] for c in msg.get("tool_calls") or []],
            "finish_reason": choice["finish_reason"],
            "logprobs": (choice.get("logprobs") or {}).get("content") or [],
            "reasoning_logprobs": (choice.get("reasoning_logprobs") or {}).get("content") or []}


TWO_CALLS = (
    "I should look both up.</think>\n\nOne moment.\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
)
BARE_CALL = ("Checking.</think>\n\nSure thing\n"
             "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>")
# Content ending in a proper prefix of `<function=`: the tool parser holds it to the end, so
# the entry of "function" is labelled only then and rides on the finish chunk (rule 5).
HELD = "Checking.</think>\n\nCall <function"
# Meant for enable_thinking false + tool_choice "none": markers inside content stay text.
RULE6 = ' Plain </think> text\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> done.'


def chat_scripts(tok) -> dict[str, list[int]]:
    """Trigger (found in the prompt) -> the output ids of `chat_model_path`."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    return {
        "[two-calls]": enc(TWO_CALLS),
        "[bare-call]": enc(BARE_CALL),
        "[held]": enc(HELD),
        "[rule6]": enc(RULE6),
        # The emoji as four one-byte tokens: a character split across tokens.
        "[emoji]": [*enc("Thinking.</think>\n\nHot "), *byte_ids(tok, "🙂"),
                    *enc(" day. Nice weather today.")],
    }


HARMONY_SCRIPTS = [
    {"trigger": "weather", "text": "<|channel|>analysis<|message|>Need the weather.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
     '<|message|>{"city": "Paris"}<|call|>'},
    {"trigger": None, "text": "<|channel|>analysis<|message|>Let me think.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Use a <b> tag."},
]
