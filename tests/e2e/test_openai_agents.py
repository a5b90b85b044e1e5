"""The `openai-agents` SDK (which speaks the Responses API by default) running an agent with a
function tool to the end against `freetoken serve`, plain and streamed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from tests.fixtures import build_models as bm

pytestmark = pytest.mark.slow


# Asked about the weather it calls get_weather for Paris; once the tool's answer is in the
# conversation (the first trigger found wins), it answers from it.
ANSWER = "It is sunny in Paris."
SCRIPT = [{"trigger": "Sunny in Paris", "text": f"The tool answered.\n</think>\n\n{ANSWER}"},
          *bm.DEFAULT_SCRIPT]


@pytest.fixture(scope="module")
def scripted(server, make_scripted_model):
    return server("--model", str(make_scripted_model(SCRIPT, alternatives=bm.DEFAULT_ALTERNATIVES)))


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def agent(server) -> Agent:
    set_tracing_disabled(True)  # no traces sent anywhere
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    return Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                 model=OpenAIResponsesModel(model=name, openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=80))


def test_an_agent_runs_its_tool_to_the_end(scripted):
    result = Runner.run_sync(agent(scripted), "What is the weather in Paris?")
    # model -> tool call -> tool -> model again -> its final answer
    calls = [item.raw_item.name for item in result.new_items if item.type == "tool_call_item"]
    assert calls == ["get_weather"] and result.final_output == ANSWER


def test_a_streamed_agent_runs_its_tool_to_the_end(scripted):
    async def run() -> tuple[str, list[str]]:
        result = Runner.run_streamed(agent(scripted), "What is the weather in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert final == ANSWER and "raw_response_event" in kinds
