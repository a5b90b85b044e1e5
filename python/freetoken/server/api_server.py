"""The FastAPI app and the `FrontendManager` that connects it to the engine process.

The frontend tokenizes (in a worker thread) and detokenizes; the engine process sees token ids
only, so the HTTP loop never waits on a forward and the engine never waits on text work.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from freetoken.message import AbortMsg, DetokenizeMsg, TokenizeMsg, UserMsg, UserReply
from freetoken.server import openai_api
from freetoken.server.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from freetoken.server.validation import RequestError
from freetoken.tokenizer.reply import ReplyBuilder
from freetoken.tokenizer.tokenize import TokenizeManager


@dataclass(frozen=True)
class FrontendConfig:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_output_tokens: int | None = None
    max_logprobs: int = 20
    return_tokens_as_token_ids: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    api_key: str | None = None


@dataclass
class _ReqState:
    builder: ReplyBuilder
    replies: list[UserReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False


class FrontendManager:
    def __init__(self, config: FrontendConfig, tokenizer, in_addr: str, out_addr: str,
                 engine_alive: Callable[[], bool] = lambda: True):
        self.config, self.tokenizer = config, tokenizer
        self.tokenize_manager = TokenizeManager(tokenizer)
        self.engine_alive = engine_alive
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.connect(in_addr)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(out_addr)
        self._uids = itertools.count(1)
        self._states: dict[int, _ReqState] = {}
        self._listener: asyncio.Task | None = None
        self.engine_stats: dict[str, int] = {}  # as of the engine's last message

    @property
    def dead(self) -> bool:
        return not self.engine_alive()

    def new_user(self) -> int:
        return next(self._uids)

    @property
    def num_running(self) -> int:
        return len(self._states)

    async def send_one(self, msg: TokenizeMsg) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self.listen())
        params = msg.sampling_params
        # Harmony's channel markers are special tokens that its parsers must see in the text.
        harmony_chat = isinstance(msg.text, list) and msg.text and isinstance(msg.text[0], dict) \
            and "gpt_oss" in (self.config.reasoning_parser, self.config.tool_call_parser)
        self._states[msg.uid] = _ReqState(
            ReplyBuilder(self.tokenizer, params.stop_strs, skip_special_tokens=not harmony_chat))
        if self.dead:
            return self._fail(msg.uid, "The engine process has stopped", "engine_dead")
        try:
            ids = await asyncio.to_thread(self.tokenize_manager.tokenize, msg)
        except Exception as exc:  # a template that cannot render this conversation
            return self._fail(msg.uid, f"Could not render the prompt: {exc}", "invalid_prompt")
        if not ids:
            return self._fail(msg.uid, "The prompt is empty after tokenization", "invalid_prompt")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            return self._fail(msg.uid, f"This model's maximum context length is {limit} tokens, "
                              f"but the prompt has {len(ids)} tokens.", "context_length_exceeded")
        await self._to_engine.send(pickle.dumps(UserMsg(msg.uid, ids, params)))

    async def abort_user(self, uid: int) -> None:
        state = self._states.pop(uid, None)
        if state is not None and not state.done:
            await self._to_engine.send(pickle.dumps(AbortMsg(uid)))

    async def wait_for_ack(self, uid: int):
        state = self._states[uid]
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                replies, state.replies = state.replies, []
                for reply in replies:
                    yield reply
                    if reply.finished:
                        return
        finally:
            # A client that went away (or an error elsewhere) must not leave KV behind.
            await self.abort_user(uid)

    def _fail(self, uid: int, message: str, code: str) -> None:
        self._push(uid, UserReply(uid, finished=True, finish_reason="error", error=message,
                                  error_code=code))

    def _push(self, uid: int, reply: UserReply) -> None:
        state = self._states.get(uid)
        if state is None:
            return
        state.done = state.done or reply.finished
        state.replies.append(reply)
        state.event.set()

    async def listen(self) -> None:
        while True:
            if await self._from_engine.poll(500):
                msgs, self.engine_stats = pickle.loads(await self._from_engine.recv())
                for msg in msgs:
                    await self._on_engine_msg(msg)
            elif self.dead:
                for uid in list(self._states):
                    self._fail(uid, "The engine process has stopped", "engine_dead")

    async def _on_engine_msg(self, msg: DetokenizeMsg) -> None:
        state = self._states.get(msg.uid)
        if state is None or state.done:
            return  # aborted, or already ended by a stop string
        if msg.error:
            return self._fail(msg.uid, msg.error, msg.error_code or "error")
        reply = state.builder.build(msg)
        if reply.finished and not msg.finished:  # a stop string matched
            await self._to_engine.send(pickle.dumps(AbortMsg(msg.uid)))
        self._push(msg.uid, reply)


def _error_param(exc: RequestValidationError) -> str | None:
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None


def create_app(get_state: Callable[[], FrontendManager]) -> FastAPI:
    app = FastAPI(title="FreeToken")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return openai_api.create_error_response(message, param=_error_param(exc))

    @app.middleware("http")
    async def _gate(request: Request, call_next):
        state = get_state()
        key = state.config.api_key
        if key and request.url.path.startswith("/v1") and \
                request.headers.get("authorization") != f"Bearer {key}":
            return openai_api.create_error_response("Invalid API key", 401, "authentication_error")
        if state.dead and request.url.path != "/health":
            return openai_api.create_error_response("The engine process has stopped", 503,
                                                    "server_error", code="engine_dead")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if get_state().dead:
            return openai_api.create_error_response("The engine process has stopped", 503,
                                                    "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats():
        state = get_state()
        return {"engine": state.engine_stats, "frontend_requests": state.num_running}

    @app.get("/v1/models")
    async def models():
        cfg = get_state().config
        card = ModelCard(id=cfg.served_model_name, root=cfg.served_model_name,
                         max_model_len=cfg.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await openai_api.handle_completion(req, request, get_state(), {})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await openai_api.handle_chat_completion(req, request, get_state(), {})

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state = get_state()
        if (req.prompt is None) == (req.messages is None):
            return openai_api.create_error_response("give exactly one of prompt or messages",
                                                    param="prompt")
        if req.prompt is not None:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            msg = TokenizeMsg(0, [m.model_dump(exclude_none=True) for m in req.messages], None)
            ids = state.tokenize_manager.tokenize(msg)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state = get_state()
        bad = [t for t in req.tokens if not 0 <= t < state.config.vocab_size]
        if bad:
            return openai_api.error_from(
                RequestError(f"Token id {bad[0]} is out of vocabulary", param="tokens"))
        return {"prompt": state.tokenizer.decode(req.tokens)}

    return app
