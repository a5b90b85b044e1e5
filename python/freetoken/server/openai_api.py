"""Upstream's `freetoken.server.openai_api`: the OpenAI handlers, now in `freetoken.serving`."""

from freetoken.serving.api_models import ChatCompletionRequest, CompletionRequest
from freetoken.serving.chat import handle_chat_completion, stream_chat_completion_chunks
from freetoken.serving.completion import handle_completion, stream_completion_chunks

__all__ = ["ChatCompletionRequest", "CompletionRequest", "handle_chat_completion",
           "handle_completion", "stream_chat_completion_chunks", "stream_completion_chunks"]
