"""The engine client: `FrontendManager` connects the HTTP side to the engine process.

It tokenizes (in a worker thread) and detokenizes; the engine process sees token ids only, so the
HTTP loop never waits on a forward and the engine never waits on text work. `EngineClient` is
what the handlers need of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, runtime_checkable

import zmq
import zmq.asyncio

from freetoken.config import FrontendConfig
from freetoken.core import SamplingParams
from freetoken.parsing import registry
from freetoken.message import AbortMsg, DetokenizeMsg, ExitMsg, TokenizeMsg, UserMsg, UserReply
from freetoken.serving import errors
from freetoken.serving.errors import RequestError
from freetoken.serving.metrics import Metrics, RequestTimer
from freetoken.tokenizer.reply import ReplyBuilder
from freetoken.tokenizer.tokenize import TokenizeManager, bad_words_token_ids

log = logging.getLogger("freetoken")


@runtime_checkable
class EngineClient(Protocol):
    """What the OpenAI handlers use of the engine side, `FrontendManager` being the one the
    server runs. `config` holds `FrontendConfig`'s fields; a limit it lacks takes its default
    (`Limits.of`)."""

    config: Any

    def new_user(self) -> int: ...

    async def send_one(self, msg: TokenizeMsg) -> None: ...

    def wait_for_ack(self, uid: int) -> AsyncIterator[UserReply]: ...


@dataclass
class _ReqState:
    builder: ReplyBuilder | None  # None for a pooling request: its one reply has no text
    replies: list[UserReply] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    prompt_ids: list[int] = field(default_factory=list)  # kept for prompt logprobs only
    timer: RequestTimer = field(default_factory=RequestTimer)


def _is_chat(msg: TokenizeMsg) -> bool:
    return isinstance(msg.text, list) and bool(msg.text) and isinstance(msg.text[0], dict)


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
        self.draining = False  # shutting down: new requests get 503, running ones may finish
        self._dead = False
        self.metrics = Metrics(config.served_model_name, lambda: self.engine_stats)

    @property
    def dead(self) -> bool:
        # Latched: an engine seen dead stays dead (nothing restarts it in this process).
        if not self._dead and not self.engine_alive():
            self._dead = True
        return self._dead

    def new_user(self) -> int:
        return next(self._uids)

    @property
    def num_running(self) -> int:
        return len(self._states)

    async def tokenize(self, msg: TokenizeMsg, param: str) -> list[int]:
        """The prompt's token ids, tokenized in a worker thread so the HTTP loop never waits on
        it; a prompt that cannot fit the context by its size alone is refused untokenized."""
        self._check_size(msg, param)
        return await asyncio.to_thread(self._tokenized, msg, param)

    def _check_size(self, msg: TokenizeMsg, param: str) -> None:
        limit = self.config.max_model_len
        if self.tokenize_manager.min_tokens(msg) >= limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens; the "
                               "prompt is longer than that.", param=param,
                               code="context_length_exceeded")

    def _tokenized(self, msg: TokenizeMsg, param: str) -> list[int]:
        try:
            ids = self.tokenize_manager.tokenize(msg)
        except Exception as exc:  # a template that cannot render this conversation, bad text
            raise RequestError(f"Could not render the prompt: {exc}", param=param,
                               code="invalid_prompt") from None
        if not ids:
            raise RequestError("The prompt is empty after tokenization", param=param,
                               code="invalid_prompt")
        return ids

    def _open(self, msg: TokenizeMsg) -> _ReqState:
        if self._listener is None:
            self._listener = asyncio.create_task(self.listen())
        params = msg.sampling_params
        # Parsed chat output needs each token's text (and Harmony's markers, special tokens).
        builder = None if params.pooling is not None else ReplyBuilder(
            self.tokenizer, params.stop_strs, **reply_options(self.config, _is_chat(msg), params))
        state = self._states[msg.uid] = _ReqState(builder)
        return state

    def _user_msg(self, msg: TokenizeMsg, state: _ReqState, ids: list[int]) -> UserMsg:
        params = msg.sampling_params
        if params.prompt_logprobs is not None:
            state.prompt_ids = ids
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        # The engine checks the context length (prompt, and prompt + max_tokens) exactly.
        return UserMsg(msg.uid, ids, params)

    async def send_one(self, msg: TokenizeMsg) -> None:
        state = self._open(msg)
        if self.dead:
            return self._fail(msg.uid, errors.ENGINE_DEAD, "engine_dead")
        try:
            ids = await self.tokenize(msg, "messages" if _is_chat(msg) else "prompt")
            await self._to_engine.send(pickle.dumps(self._user_msg(msg, state, ids)))
        except RequestError as exc:
            return self._fail(msg.uid, exc.message, exc.code or "invalid_prompt")
        except asyncio.CancelledError:
            # The client left before wait_for_ack (whose exit aborts) began: abort here, or the
            # request would run, and its state stay, for nobody.
            await self.abort_user(msg.uid)
            raise

    async def send_many(self, msgs: list[TokenizeMsg]) -> None:
        """`send_one` for requests meant to meet in one step (rerank, score, labels,
        embeddings): tokenized in one worker-thread hop and handed to the engine as one message,
        which it queues whole before its next step (sent one by one, the first few would run as
        a step of their own). A prompt that fails is answered with its error alone."""
        states = [self._open(msg) for msg in msgs]
        if self.dead:
            for msg in msgs:
                self._fail(msg.uid, errors.ENGINE_DEAD, "engine_dead")
            return

        def prepare() -> tuple[list[UserMsg], list[tuple[int, RequestError]]]:
            ready, failed, sized = [], [], []
            for msg, state in zip(msgs, states):
                param = "messages" if _is_chat(msg) else "prompt"
                try:
                    self._check_size(msg, param)
                    sized.append((msg, state, param))
                except RequestError as exc:
                    failed.append((msg.uid, exc))
            texts = self.tokenize_manager.tokenize_texts([msg for msg, _, _ in sized])
            for msg, state, param in sized:
                try:  # an empty prompt goes to _tokenized, for its error
                    ids = texts.get(msg.uid) or self._tokenized(msg, param)
                    ready.append(self._user_msg(msg, state, ids))
                except RequestError as exc:
                    failed.append((msg.uid, exc))
            return ready, failed

        try:
            ready, failed = await asyncio.to_thread(prepare)
            for uid, exc in failed:  # here, on the loop: replies wake their readers
                self._fail(uid, exc.message, exc.code or "invalid_prompt")
            if ready:
                await self._to_engine.send(pickle.dumps(ready))
        except asyncio.CancelledError:
            for msg in msgs:
                await self.abort_user(msg.uid)
            raise

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
        if reply.finished and not state.done:
            self.metrics.on_finish(state.timer, reply.finish_reason)
        state.done = state.done or reply.finished
        state.replies.append(reply)
        state.event.set()

    async def listen(self) -> None:
        while True:
            if await self._from_engine.poll(500):
                try:
                    msgs, self.engine_stats = pickle.loads(await self._from_engine.recv())
                except Exception:  # one bad message must not stop every reply that follows
                    log.exception("dropped an engine message that failed to unpickle")
                    continue
                for msg in msgs:
                    try:
                        await self._on_engine_msg(msg)
                    except Exception as exc:  # e.g. a detokenizer fault: end this request only
                        log.exception("handling the engine's reply to request %s failed", msg.uid)
                        self._fail(msg.uid, f"Internal error while building the reply: {exc}",
                                   "engine_error")
            elif self.dead:
                self.fail_all(errors.ENGINE_DEAD, "engine_dead")

    def fail_all(self, message: str, code: str) -> int:
        """End every open request with an error reply (code "shutdown" or "engine_dead": the
        HTTP layer answers 503); returns how many were ended."""
        open_uids = [uid for uid, state in self._states.items() if not state.done]
        for uid in open_uids:
            self._fail(uid, message, code)
        return len(open_uids)

    async def close(self, stop_engine: bool = True) -> None:
        """Ask the engine to exit (ExitMsg) and close this side's sockets; the launcher joins,
        and if need be kills, the engine process."""
        if self._listener is not None:
            self._listener.cancel()
        if stop_engine and not self.dead:
            try:
                await asyncio.wait_for(self._to_engine.send(pickle.dumps(ExitMsg())), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        self._to_engine.close(linger=500)  # long enough for the ExitMsg to leave
        self._from_engine.close(linger=0)
        self._ctx.term()

    async def _on_engine_msg(self, msg: DetokenizeMsg) -> None:
        state = self._states.get(msg.uid)
        if state is None or state.done:
            return  # aborted, or already ended by a stop string
        if msg.error:
            return self._fail(msg.uid, msg.error, msg.error_code or "error")
        reply = state.builder.build(msg) if state.builder is not None else _pooled_reply(msg)
        if msg.token_ids:
            self.metrics.on_tokens(state.timer, msg.prompt_tokens, len(msg.token_ids))
        if reply.prompt_logprobs is not None:
            reply.prompt_token_ids = state.prompt_ids
        if reply.finished and not msg.finished:  # a stop string matched
            await self._to_engine.send(pickle.dumps(AbortMsg(msg.uid)))
        self._push(msg.uid, reply)


def _pooled_reply(msg: DetokenizeMsg) -> UserReply:
    """A pooling request's reply: its vector and counts (the token it sampled is never read)."""
    return UserReply(msg.uid, finished=msg.finished, finish_reason=msg.finish_reason,
                     prompt_tokens_delta=msg.prompt_tokens, cached_tokens=msg.cached_tokens,
                     embedding=msg.embedding)


def reply_options(config: FrontendConfig, chat: bool, params: SamplingParams) -> dict:
    """How a request's replies are built (`ReplyBuilder`'s options): chat output that a parser
    reads needs each token's text, and some families' markers are special tokens kept in it
    whatever `skip_special_tokens` says (the parser takes them out of the content). A chat
    under a grammar may be forced tool calls, parsed even on a server without a tool parser."""
    reasoning, tool = config.reasoning_parser, config.tool_call_parser
    parsed = chat and (reasoning is not None or tool is not None or params.structured is not None)
    keep = parsed and registry.keeps_special_tokens(reasoning, tool)
    return {"skip_special_tokens": params.skip_special_tokens and not keep,
            "token_texts": parsed,
            "include_stop_str_in_output": params.include_stop_str_in_output,
            "min_tokens": params.min_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens}
