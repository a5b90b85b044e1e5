"""Pydantic request and response models: the HTTP edge, and the only place pydantic is used.

Requests keep `extra="allow"` as upstream, so a field we do not declare is still seen:
`validation.unsupported_reason` answers every undeclared field that could change the result with a 400 instead of
dropping it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

TokenIds = list[StrictInt]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool = False


class _SamplingFields(OpenAIBaseModel):
    """Fields that both endpoints turn into `SamplingParams`."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    allowed_token_ids: TokenIds | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    # Any shape: structured.py checks it and names what is wrong.
    response_format: Any = None
    # Declared so its neutral values pass; any other value is refused in validation.py.
    best_of: StrictInt | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds] | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # a raw prompt gets the tokenizer's BOS etc.


class FunctionDef(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIBaseModel):
    type: str = "function"
    function: FunctionDef


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class Message(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    include_reasoning_logprobs: StrictBool = False
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False  # the chat template brings its own


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool | None = None  # prompt: true, messages: false (vLLM's)


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: TokenIds


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "freetoken"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
