"""A conversation as requests carry it (messages, content parts, tool calls, tools), and what a
chat template reads of it. Pydantic, as every request model (protocol.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


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

    def for_template(self) -> dict:
        """The message as a chat template reads it: text parts joined, arguments parsed."""
        msg = self.model_dump(exclude_none=True)
        if self.role == "assistant" and self.tool_calls and self.content is None:
            msg["content"] = ""  # the openai SDK and LangChain send null beside tool_calls
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text or "" for part in self.content)
        for call in msg.get("tool_calls", []):
            args = call["function"].get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] = _json_or_text(args)
        return msg


def _json_or_text(text: str) -> Any:
    # Chat templates render tool-call arguments as objects; clients send them as JSON text.
    try:
        return json.loads(text)
    except ValueError:
        return text
