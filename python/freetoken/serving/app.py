"""The FastAPI app: routes, and the gate (API key, engine state) in front of them."""

from __future__ import annotations

import asyncio
import hmac
from typing import Callable

from fastapi import FastAPI, Request, Response

from freetoken.serving import errors, metrics
from freetoken.serving.adapters import anthropic, responses
from freetoken.serving.client import FrontendManager
from freetoken.serving.errors import AsciiJSONResponse, RequestError
from freetoken.serving.handling import check_model
from freetoken.serving.limits import Limits
from freetoken.serving.openai import chat, completion
from freetoken.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               TokenizeRequest)
from freetoken.serving.playground import Playground
from freetoken.serving.pooling import embeddings, generative_scoring, rerank
from freetoken.serving.pooling.protocol import (EmbeddingRequest, GenerativeScoringRequest, RerankRequest,
                                                ScoreRequest)


def _authorized(headers: dict, key: str) -> bool:
    """`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it."""
    bearer = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = bearer.partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get(b"x-api-key", b"").decode("latin-1")
    # Constant-time: the comparison must not tell an attacker how much of the key matched.
    return bool(token) and hmac.compare_digest(token.strip().encode(), key.encode())


def create_app(get_state: Callable[[], FrontendManager]):
    """The FastAPI app, wrapped in the request-body limit (an ASGI app either way)."""
    app = FastAPI(title="FreeToken", default_response_class=AsciiJSONResponse)
    errors.install(app)
    limits = Limits.of(get_state().config)

    @app.get("/health")
    async def health():
        state = get_state()
        if state.dead:
            return errors.error_response(errors.ENGINE_DEAD, 503, code="engine_dead")
        if state.draining:  # a load balancer stops sending traffic here
            return errors.error_response(errors.SHUTTING_DOWN, 503, code="shutdown")
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats():
        state = get_state()
        return {"engine": state.engine_stats, "frontend_requests": state.num_running}

    @app.get(metrics.PATH)
    async def prometheus_metrics():
        body, content_type = get_state().metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(get_state().config)]}

    @app.get("/v1/models/{model_id:path}")  # :path: served names may hold slashes (org/name)
    async def model(model_id: str):
        state = get_state()
        check_model(model_id, state)
        return _model_card(state.config)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await completion.create_completion(req, request, get_state(), limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat.create_chat_completion(req, request, get_state(), limits)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await anthropic.create_message(request, get_state(), limits)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic.count_tokens(request, get_state(), limits)

    store = responses.ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await responses.create_response(request, get_state(), limits, store)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return store.get(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return store.delete(response_id)

    @app.post("/v1/embeddings")
    async def embeddings_route(req: EmbeddingRequest, request: Request):
        return await embeddings.create_embeddings(req, request, get_state(), limits)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank_route(req: RerankRequest, request: Request):
        return await rerank.create_rerank(req, request, get_state(), limits.max_running_requests)

    @app.post("/score")
    @app.post("/v1/score")
    async def score_route(req: ScoreRequest, request: Request):
        return await rerank.create_score(req, request, get_state(), limits.max_running_requests)

    @app.post("/generative_scoring")
    async def generative_scoring_route(req: GenerativeScoringRequest, request: Request):
        return await generative_scoring.create_generative_scoring(req, request, get_state(), limits)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state = get_state()
        ids = await state.tokenize(req.to_msg(), req.input_field)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.config.max_model_len}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_config(get_state().tokenizer)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state = get_state()
        bad = [t for t in req.tokens if not 0 <= t < state.config.vocab_size]
        if bad:
            raise RequestError(f"Token id {bad[0]} is out of vocabulary", param="tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, req.tokens)}

    gated = _Gate(errors.BodyLimit(app, lambda: get_state().config.max_request_bytes), get_state)
    # getattr: a state may have no metrics.
    counted = metrics.HttpMetrics(gated, lambda: getattr(get_state(), "metrics", None),
                                  {route.path for route in app.routes})
    return Playground(counted, get_state)


def _model_card(cfg) -> dict:
    return {"id": cfg.served_model_name, "object": "model", "created": 0, "owned_by": "freetoken",
            "root": cfg.served_model_name, "max_model_len": cfg.max_model_len}


def tokenizer_config(tokenizer) -> dict:
    """vLLM's `/tokenizer_info`: the tokenizer's init arguments (special tokens as their text,
    no file paths), its class and chat template; lm-eval's remote tokenizer reads it."""

    def plain(value):
        if hasattr(value, "content"):  # AddedToken
            return value.content
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

    config = {k: plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file")}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


class _Gate:
    """The API key and the engine's state, checked before a request reaches FastAPI. Pure ASGI:
    FastAPI's `@app.middleware` would wrap the body reader and turn the 413 into a 400."""

    def __init__(self, app, get_state: Callable[[], FrontendManager]):
        self.app, self.get_state = app, get_state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (refusal := self._refusal(scope)) is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope):
        # Open to probes and scrapers, as vLLM's: they tell up or down, and counts, no content;
        # and a draining or dead server's metrics are still worth a scrape.
        if scope["path"] in ("/health", metrics.PATH):
            return None
        state = self.get_state()
        key = state.config.api_key
        # Anthropic's clients read errors in Anthropic's shape.
        shaped = errors.anthropic_error if scope["path"].startswith("/v1/messages") \
            else errors.error_from
        if key and not _authorized(dict(scope.get("headers", ())), key):
            return shaped(RequestError("Invalid API key", status=401))
        if state.dead:
            return shaped(RequestError(errors.ENGINE_DEAD, code="engine_dead", status=503))
        if state.draining:
            return shaped(RequestError(errors.SHUTTING_DOWN, code="shutdown", status=503))
        return None
