"""The Responses API's events from chat's (`generation`): an output item per run of reasoning,
of content (a message with one output_text part) or per tool call, each opened with
`output_item.added`, filled by deltas and closed with its `.done` events, numbered by
`sequence_number` and `output_index`. The response the last event carries is the non-streamed
response, so the two modes cannot disagree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Callable

from freetoken.serving.openai import generation
from freetoken.serving.errors import RequestError
from freetoken.serving.handling import token_texts
from freetoken.serving.logprob_format import chat_entries


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Builder:
    """The response being built and the events that build it."""

    def __init__(self, head: dict, entries: Callable[[list], list]):
        self.response = {**head, "status": "in_progress", "output": [], "usage": None,
                         "incomplete_details": None}
        self.entries = entries
        self.seq = 0
        self.key: Any = None  # what the open item holds: "reasoning", "message", a call index

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    @property
    def index(self) -> int:
        return len(self.response["output"]) - 1

    @property
    def item(self) -> dict:
        return self.response["output"][-1]

    def _where(self, part: bool = True) -> dict:
        where = {"item_id": self.item["id"], "output_index": self.index}
        return {**where, "content_index": 0} if part else where

    def open(self, key: Any, item: dict, part: dict | None) -> list[dict]:
        if key == self.key:
            return []
        out = self.close()
        self.key = key
        self.response["output"].append(item)
        out.append(self.event("response.output_item.added", output_index=self.index,
                              item=json.loads(json.dumps(item))))
        if part is not None:
            item["content"].append(part)
            out.append(self.event("response.content_part.added", **self._where(), part=dict(part)))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        if self.key is None:
            return []
        item, out = self.item, []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **self._where(False),
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
            extra = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
            out.append(self.event(f"response.{kind}.done", **self._where(), text=part["text"],
                                  **extra))
            out.append(self.event("response.content_part.done", **self._where(), part=part))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=self.index,
                              item=json.loads(json.dumps(item))))
        self.key = None
        return out

    def feed(self, ev: Any) -> list[dict]:
        if isinstance(ev, generation.ReasoningDelta):
            out = self.open("reasoning", {"type": "reasoning", "id": _id("rs"), "summary": [],
                                          "content": [], "status": "in_progress"},
                            {"type": "reasoning_text", "text": ""})
            self.item["content"][0]["text"] += ev.text
            return out + [self.event("response.reasoning_text.delta", **self._where(),
                                     delta=ev.text)]
        if isinstance(ev, generation.ContentDelta):
            out = self.open("message", {"type": "message", "id": _id("msg"), "role": "assistant",
                                        "status": "in_progress", "content": []},
                            {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            part, logprobs = self.item["content"][0], self.entries(ev.logprobs)
            part["text"] += ev.text
            part["logprobs"] += logprobs
            return out + [self.event("response.output_text.delta", **self._where(),
                                     delta=ev.text, logprobs=logprobs)]
        if isinstance(ev, generation.ToolCallDelta):
            out = self.open(ev.index, {"type": "function_call", "id": _id("fc"), "call_id": ev.id,
                                       "name": ev.name, "arguments": "",
                                       "status": "in_progress"}, None)
            if not ev.arguments:
                return out
            self.item["arguments"] += ev.arguments
            return out + [self.event("response.function_call_arguments.delta",
                                     **self._where(False), delta=ev.arguments)]
        return []

    def finish(self, done: generation.GenDone) -> list[dict]:
        cut = done.finish_reason == "length"
        out = self.close("incomplete" if cut else "completed")
        messages = [i for i in self.response["output"] if i["type"] == "message"]
        if messages:  # entries the parser could place only at the end
            messages[-1]["content"][0]["logprobs"] += self.entries(done.logprobs)
        self.response.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": done.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": done.cached_tokens,
                                            "cache_write_tokens": 0},
                   "output_tokens": done.completion_tokens,
                   "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens},
                   "total_tokens": done.prompt_tokens + done.completion_tokens})
        return out + [self.event(f"response.{self.response['status']}", response=self.response)]


async def response_events(events: AsyncIterator, head: dict, spec: generation.GenSpec, state,
                          keep: Callable[[dict], None]) -> AsyncIterator[dict]:
    """The Responses events of one generation; `keep` gets the finished response."""
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids
    entries = (lambda lps: chat_entries(lps, texts, as_ids)) if spec.logprobs \
        else (lambda lps: [])
    builder = _Builder(head, entries)
    snapshot = json.loads(json.dumps(builder.response))
    yield builder.event("response.created", response=snapshot)
    yield builder.event("response.in_progress", response=snapshot)
    async for ev in events:
        out = builder.finish(ev) if isinstance(ev, generation.GenDone) else builder.feed(ev)
        if isinstance(ev, generation.GenDone):
            keep(builder.response)
        for e in out:
            yield e


async def final_response(events: AsyncIterator[dict]) -> dict:
    response = None
    async for ev in events:
        response = ev.get("response")
    return response


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    last = -1
    try:
        async for ev in events:
            last = ev["sequence_number"]
            yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"
    except RequestError as exc:
        error = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param,
                 "sequence_number": last + 1}
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
