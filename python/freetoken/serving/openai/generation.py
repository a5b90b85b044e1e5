"""Chat generation as a stream of semantic events, shared by streaming and non-streaming.

Per reply: the released tokens, with their text, go through the request's output parser
(freetoken.parsing), which makes the reasoning and content deltas and the tool-call items and
labels each token from the same reading; the router pairs the labels with the tokens' logprob
entries, and each emitted delta takes the entries held for its side. The non-streaming response
is `collect()` over the very same events, so the two modes cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from freetoken.core import SamplingParams, TokenLogprob
from freetoken.message import TokenizeMsg, UserReply
from freetoken.parsing import Label, LogprobRouter, Step, registry
from freetoken.serving.errors import reply_error


@dataclass
class GenSpec:
    messages: list[dict]
    sampling_params: SamplingParams
    chat_template_kwargs: dict
    template_tools: list[dict] | None
    parser_tools: list[dict] | None  # None: no tool parsing (no tools, or tool_choice "none")
    reasoning_parser: str | None
    tool_call_parser: str | None
    force_reasoning: bool
    logprobs: bool
    include_reasoning_logprobs: bool
    special_ids: frozenset[int] = frozenset()  # labelled SPECIAL for chat logprobs
    structured_param: str | None = None  # the field named if its grammar does not compile
    add_special_tokens: bool = False  # the template brings its own; true adds the tokenizer's too


@dataclass
class ReasoningDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ContentDelta:
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_delta(self) -> dict:
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
            return {"index": self.index, "id": self.id, "type": "function", "function": function}
        return {"index": self.index, "function": function}


@dataclass
class GenStart:
    """The first event: the prompt's size, known before any output."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class GenDone:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # content entries still held
    reasoning_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    matched_stop: int | str | None = None  # the stop string or stop token id that ended it
    reasoning_tokens: int = 0  # the tokens the parser read as reasoning


@dataclass
class GenResult:
    content: str | None
    reasoning: str
    tool_calls: list[dict]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    content_logprobs: list[TokenLogprob]
    reasoning_logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    matched_stop: int | str | None = None


async def generate_events(state, spec: GenSpec) -> AsyncIterator:
    """Submit the request and return its event stream; the first reply is awaited here so a
    failure before any output (an over-long prompt, a template error) is still a plain 400."""
    uid = state.new_user()
    await state.send_one(TokenizeMsg(uid, spec.messages, spec.sampling_params,
                                     chat_template_kwargs=spec.chat_template_kwargs,
                                     tools=spec.template_tools,
                                     add_special_tokens=spec.add_special_tokens))
    replies = state.wait_for_ack(uid).__aiter__()
    first = await replies.__anext__()
    if first.error:
        await replies.aclose()
        raise reply_error(first.error, first.error_code)
    return _events(spec, first, replies)


async def _events(spec: GenSpec, first: UserReply, replies) -> AsyncIterator:
    parser = registry.output_parser(spec.reasoning_parser, spec.tool_call_parser,
                                    spec.parser_tools, spec.force_reasoning, spec.special_ids)
    router = LogprobRouter()
    prompt_tokens = completion_tokens = cached = reasoning_tokens = 0
    called = False

    def step_events(step: Step):
        nonlocal called
        if step.reasoning:
            yield ReasoningDelta(step.reasoning, router.take(Label.REASONING))
        if step.content:
            yield ContentDelta(step.content, router.take(Label.CONTENT))
        for item in step.calls:
            if item.name is not None:
                called = True
                yield ToolCallDelta(item.tool_index, registry.call_id(spec.tool_call_parser),
                                    item.name, "")
            if item.parameters:
                yield ToolCallDelta(item.tool_index, arguments=item.parameters)

    yield GenStart(first.prompt_tokens_delta, first.cached_tokens)
    reply: UserReply | None = first
    while reply is not None:
        if reply.error:
            raise reply_error(reply.error, reply.error_code)
        prompt_tokens += reply.prompt_tokens_delta
        completion_tokens += reply.completion_tokens_delta
        cached = max(cached, reply.cached_tokens)
        entries = list(reply.logprobs[: len(reply.token_ids)])  # one per released token
        router.add(entries + [None] * (len(reply.token_ids) - len(entries)))
        step = parser.feed(reply.token_ids, reply.incremental_output, reply.token_texts)
        router.route(step.labels)
        reasoning_tokens += step.labels.count(Label.REASONING)
        for ev in step_events(step):
            yield ev
        if reply.finished:
            break
        reply = await anext(replies, None)
    step = parser.finish()
    for ev in step_events(step):  # what the end released; entries labelled only now...
        yield ev
    router.route(step.labels)  # ...go on the finish chunk
    reasoning_tokens += step.labels.count(Label.REASONING)
    finish = reply.finish_reason if reply is not None else None
    if called and finish != "length":
        finish = "tool_calls"
    yield GenDone(finish, prompt_tokens, completion_tokens, cached,
                  router.take(Label.CONTENT), router.take(Label.REASONING), first.prompt_logprobs,
                  reply.matched_stop if reply is not None else None, reasoning_tokens)


async def collect(events: AsyncIterator) -> GenResult:
    content, reasoning = [], []
    content_lps: list[TokenLogprob] = []
    reasoning_lps: list[TokenLogprob] = []
    calls: dict[int, dict] = {}
    async for ev in events:
        if isinstance(ev, ContentDelta):
            content.append(ev.text)
            content_lps += ev.logprobs
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
            reasoning_lps += ev.logprobs
        elif isinstance(ev, ToolCallDelta):
            call = calls.setdefault(ev.index, {"id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}})
            call["function"]["arguments"] += ev.arguments
        elif isinstance(ev, GenDone):
            content_lps += ev.logprobs
            reasoning_lps += ev.reasoning_logprobs
            done = ev
    text = "".join(content)
    return GenResult(
        content=None if not text and calls else text,
        reasoning="".join(reasoning),
        tool_calls=[calls[i] for i in sorted(calls)],
        finish_reason=done.finish_reason,
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        cached_tokens=done.cached_tokens,
        content_logprobs=content_lps,
        reasoning_logprobs=reasoning_lps,
        prompt_logprobs=done.prompt_logprobs,
        matched_stop=done.matched_stop,
    )
