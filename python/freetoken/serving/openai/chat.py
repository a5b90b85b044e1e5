"""`/v1/chat/completions`: the request's generation spec (with the grammar a forced tool call or
a structured output imposes, placed after the reasoning), `generation`'s events, JSON or SSE
shaped from them. `state` is an `EngineClient` (client.py)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi.responses import StreamingResponse

from freetoken.core import SamplingParams, StructuredSpec
from freetoken.parsing import LogprobsUnavailable, registry
from freetoken.parsing.family import special_ids
from freetoken.parsing.tool_grammar import token_literal
from freetoken.serving.openai import generation, structured
from freetoken.serving.errors import RequestError, error_body, error_from
from freetoken.serving.handling import (
    all_or_none,
    check_model,
    fingerprint,
    merged,
    sampling_defaults_refused,
    sse,
    token_texts,
    until_disconnected,
    usage_dict,
)
from freetoken.serving.limits import Limits
from freetoken.serving.logprob_format import chat_entries, vllm_prompt_logprobs
from freetoken.serving.openai.protocol import ChatCompletionRequest
from freetoken.serving.openai.structured import Requested

if TYPE_CHECKING:
    from freetoken.serving.client import EngineClient


async def handle_chat_completion(req: ChatCompletionRequest, raw_request, state: EngineClient,
                                 model_sampling: dict | None = None):
    """Upstream FreeToken's handler signature, for callers of the handler itself: the limits
    come from `state.config`."""
    if model_sampling:
        return sampling_defaults_refused()
    return await create_chat_completion(req, raw_request, state, Limits.of(state.config))


async def create_chat_completion(req: ChatCompletionRequest, raw_request, state: EngineClient,
                                 limits: Limits):
    try:
        spec = await prepare(req, state, limits)
        specs = _choice_specs(spec, req.n)
        if req.stream:
            streams = await all_or_none([generation.generate_events(state, s) for s in specs])
            return StreamingResponse(stream_chat_completion_chunks(state, req, spec, streams),
                                     media_type="text/event-stream")

        async def result_of(choice_spec: generation.GenSpec) -> generation.GenResult:
            return await generation.collect(await generation.generate_events(state, choice_spec))

        results = await until_disconnected(raw_request, all_or_none([result_of(s) for s in specs]))
    except RequestError as exc:
        return error_from(exc)
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids

    def choice(index: int, result: generation.GenResult) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if spec.reasoning_parser is not None:
            message["reasoning_content"] = result.reasoning or None
        if result.tool_calls:
            message["tool_calls"] = result.tool_calls
        out: dict[str, Any] = {"index": index, "message": message,
                               "finish_reason": result.finish_reason, "logprobs": None}
        if spec.logprobs:
            out["logprobs"] = {"content": chat_entries(result.content_logprobs, texts, as_ids),
                               "refusal": None}
        if spec.include_reasoning_logprobs:
            out["reasoning_logprobs"] = {"content": chat_entries(result.reasoning_logprobs, texts,
                                                                 as_ids)}
        return out

    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or state.config.served_model_name,
        "choices": [choice(i, r) for i, r in enumerate(results)],
        "usage": _usage(results),
        **fingerprint(state),
    }
    if spec.sampling_params.prompt_logprobs is not None:
        # One prompt for all choices: vLLM puts its logprobs beside the choices.
        response["prompt_logprobs"] = vllm_prompt_logprobs(results[0].prompt_logprobs or [], texts)
    return response


# The call format forced calls are written in on a server without a tool parser: hermes's
# `<tool_call>` JSON, the tool-call format most chat templates are trained on.
FORCED_CALL_FORMAT = "hermes"


def forces_calls(tools: list[dict] | None, choice: Any) -> bool:
    return bool(tools) and (choice == "required" or isinstance(choice, dict))


def call_format(tool_parser: str | None, tools: list[dict] | None, choice: Any) -> str | None:
    """The tool parser that reads this request's calls: the server's, or for a forced
    tool_choice on a server without one `FORCED_CALL_FORMAT`, whose grammar then makes the
    model write its calls in the format read back (vLLM forces them with structured outputs
    likewise)."""
    if tool_parser is None and forces_calls(tools, choice):
        return FORCED_CALL_FORMAT
    return tool_parser


async def prepare(req: ChatCompletionRequest, state: EngineClient,
                  limits: Limits) -> generation.GenSpec:
    """The generation a chat request asks for, checked (model, limits, grammar): what chat and
    the APIs adapted onto it (anthropic.py, responses.py) run."""
    check_model(req.model, state)
    spec = _gen_spec(req, req.to_sampling_params(limits), state)
    await structured.check(state, spec.sampling_params.structured, spec.structured_param)
    return spec


def _gen_spec(req: ChatCompletionRequest, params: SamplingParams, state) -> generation.GenSpec:
    cfg = state.config
    tools, choice = req.tool_dicts, req.tool_choice
    template_tools = tools
    if isinstance(choice, dict) and tools:  # the template shows the named function alone
        template_tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    tool_parser, reasoning = call_format(cfg.tool_call_parser, tools, choice), cfg.reasoning_parser
    parser_tools = tools if tools and choice != "none" and tool_parser else None
    ctk = req.template_kwargs
    tokenizer = getattr(state, "tokenizer", None)
    grammar = output_grammar(req.structured_output, tools, choice,
                             req.parallel_tool_calls is not False, tool_parser, reasoning, ctk,
                             tokenizer)
    spec = generation.GenSpec(
        messages=[m.for_template() for m in req.messages],
        sampling_params=replace(params, structured=grammar.spec if grammar else None),
        chat_template_kwargs=ctk,
        template_tools=template_tools,
        parser_tools=parser_tools,
        reasoning_parser=reasoning,
        tool_call_parser=tool_parser if parser_tools else None,
        force_reasoning=registry.starts_in_reasoning(reasoning, ctk),
        logprobs=req.logprobs,
        include_reasoning_logprobs=req.include_reasoning_logprobs,
        add_special_tokens=req.add_special_tokens,
        structured_param=grammar.field if grammar else None,
    )
    if req.logprobs and (spec.reasoning_parser or spec.tool_call_parser):
        try:
            registry.check_logprobs(tokenizer, spec.reasoning_parser, spec.tool_call_parser)
        except LogprobsUnavailable as exc:
            raise RequestError(str(exc), param="logprobs") from None
        spec.special_ids = special_ids(tokenizer)
    return spec


def output_grammar(found: Requested | None, tools: list[dict] | None, choice: Any,
                   parallel: bool, tool_parser: str | None, reasoning: str | None,
                   chat_template_kwargs: dict, tokenizer: Any) -> Requested | None:
    """The grammar of the output and the field named if it does not compile: the tool-call
    grammar of tool_choice "required" or a named function in `tool_parser`'s format (see
    `call_format`), else the structured output asked for; either starts after the
    reasoning."""
    if forces_calls(tools, choice):
        forced = "'required'" if choice == "required" else "naming a function"
        if found is not None:
            raise RequestError(f"{found.field} cannot be combined with tool_choice {forced}: the "
                               "reply is tool calls", param=found.field)
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        literal = token_literal(tokenizer) if tokenizer is not None else json.dumps
        built = registry.tool_call_grammar(tool_parser, tools, name, parallel, literal)
        if built is None:
            raise RequestError(f"tool_choice {forced} is not available with the {tool_parser} "
                               "tool parser", param="tool_choice")
        text, spans_reasoning = built
        after = () if spans_reasoning else _answer_start(tokenizer, reasoning,
                                                         chat_template_kwargs, "tool_choice")
        return Requested(StructuredSpec("lark", text, after), "tools")
    if found is None:
        return None
    after = _answer_start(tokenizer, reasoning, chat_template_kwargs, found.field)
    return Requested(replace(found.spec, after_ids=after), found.field)


def _answer_start(tokenizer: Any, reasoning: str | None, chat_template_kwargs: dict,
                  param: str) -> tuple[int, ...]:
    """The ids after which a grammar starts: the reasoning parser's end of reasoning when the
    output starts before it, so that reasoning stays free text."""
    marker = registry.answer_marker(reasoning, chat_template_kwargs)
    if marker is None or tokenizer is None:
        return ()
    ids = list(tokenizer.encode(marker, add_special_tokens=False))
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    # A marker of plain-text pieces only has other spellings the model may write instead.
    fixed = len(ids) == 1 or any(i in added for i in ids)
    if not ids or not fixed or tokenizer.decode(ids, skip_special_tokens=False) != marker:
        raise RequestError(f"structured outputs are not available with --reasoning-parser "
                           f"{reasoning}: its end of reasoning {marker!r} is not a fixed token "
                           "sequence in this model's vocabulary", param=param)
    return tuple(ids)


def _choice_specs(spec: generation.GenSpec, n: int) -> list[generation.GenSpec]:
    """One generation per choice; seeded choices draw from seed + j, as completions do."""
    params = spec.sampling_params
    if n == 1:
        return [spec]
    return [replace(spec, sampling_params=replace(
        params, seed=None if params.seed is None else params.seed + j)) for j in range(n)]


def _usage(choices: list[generation.GenResult | generation.GenDone]) -> dict:
    # The choices share one prompt: it counts once, as vLLM's.
    return usage_dict(choices[0].prompt_tokens, sum(c.completion_tokens for c in choices),
                      choices[0].cached_tokens)


async def stream_chat_completion_chunks(state, req, spec, streams) -> AsyncIterator[str]:
    texts, as_ids = token_texts(state), spec.sampling_params.return_tokens_as_token_ids
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    model = req.model or state.config.served_model_name

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None,
              reasoning_logprobs=None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                  "finish_reason": finish_reason}
        if spec.logprobs and logprobs is not None:
            choice["logprobs"] = {"content": chat_entries(logprobs, texts, as_ids), "refusal": None}
        if spec.include_reasoning_logprobs and reasoning_logprobs:
            choice["reasoning_logprobs"] = {"content": chat_entries(reasoning_logprobs, texts, as_ids)}
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [choice], **fingerprint(state)})

    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    done: list[generation.GenDone] = []
    try:
        async for i, ev in merged(streams):
            if isinstance(ev, generation.ContentDelta):
                yield chunk(i, {"content": ev.text}, logprobs=ev.logprobs)
            elif isinstance(ev, generation.ReasoningDelta):
                yield chunk(i, {"reasoning_content": ev.text}, reasoning_logprobs=ev.logprobs)
            elif isinstance(ev, generation.ToolCallDelta):
                yield chunk(i, {"tool_calls": [ev.as_delta()]})
            elif isinstance(ev, generation.GenDone):
                done.append(ev)
                yield chunk(i, {}, ev.finish_reason, logprobs=ev.logprobs,
                            reasoning_logprobs=ev.reasoning_logprobs)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": _usage(done), **fingerprint(state)})
    except RequestError as exc:
        yield sse(error_body(exc))
    yield "data: [DONE]\n\n"
