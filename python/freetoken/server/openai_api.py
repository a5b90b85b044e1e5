"""Upstream's `freetoken.server.openai_api` names, kept for its callers: the handlers live in
`freetoken.serving`."""

from freetoken.serving.openai.chat import handle_chat_completion, stream_chat_completion_chunks
from freetoken.serving.openai.completion import handle_completion, stream_completion_chunks
from freetoken.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["ChatCompletionRequest", "CompletionRequest", "handle_chat_completion",
           "handle_completion", "stream_chat_completion_chunks", "stream_completion_chunks"]
