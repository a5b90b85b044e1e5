"""Readers for server replies: the data events of an SSE stream, and streamed chunks joined into
the shape of the non-streamed reply (completions logprobs, chat messages with calls)."""

from __future__ import annotations

import json

import httpx

from tests.support.servers import Server


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
