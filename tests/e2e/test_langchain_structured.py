"""LangChain's `with_structured_output` against `freetoken serve`: `method="json_schema"` (a
response_format) and `method="function_calling"` (a named tool_choice) return the pydantic
object."""

from __future__ import annotations

from typing import Literal

import httpx
import langchain_openai
import pytest
from pydantic import BaseModel, Field

from tests.support.chat import NO_THINKING

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(server):
    """The default model, no flags."""
    return server()


@pytest.fixture(scope="module")
def hermes_server(server, tiny_qwen3_path):
    """The tiny Qwen3 (real weights, no script) with qwen3 reasoning and hermes tool calls."""
    return server("--model", str(tiny_qwen3_path), "--tool-call-parser", "hermes",
                  "--reasoning-parser", "qwen3")


class Trip(BaseModel):
    """A trip to plan."""

    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    by_train: bool


def chat_model(server, **extra):
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="x", model=model,
                                       max_tokens=60, temperature=0, max_retries=0,
                                       timeout=600, extra_body=extra or None)


def test_json_schema_method_returns_the_model(default_server):
    llm = chat_model(default_server).with_structured_output(Trip, method="json_schema")
    assert isinstance(llm.invoke("Plan a three-day train trip to Paris."), Trip)


def test_function_calling_method_returns_the_model(hermes_server):
    # One tool family is enough here: test_structured_outputs.py covers hermes and qwen3_coder.
    llm = chat_model(hermes_server, **NO_THINKING)
    out = llm.with_structured_output(Trip, method="function_calling").invoke("Plan a trip to Oslo.")
    assert isinstance(out, Trip)
