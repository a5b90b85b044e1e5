"""The `openai-agents` SDK (which speaks the Responses API by default) running an agent with a
function tool to the end against `freetoken serve`, plain and streamed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scripted(server, scripted_model_path):
    """The default script: asked about the weather, it calls get_weather for Paris."""
    return server("--model", str(scripted_model_path))


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def agent(server) -> Agent:
    set_tracing_disabled(True)  # no traces sent anywhere
    name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    # The script calls the tool on every turn that mentions the weather: the run ends with the
    # tool's answer rather than asking the model again.
    return Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                 model=OpenAIResponsesModel(model=name, openai_client=client),
                 model_settings=ModelSettings(temperature=0, max_tokens=80),
                 tool_use_behavior="stop_on_first_tool")


def test_an_agent_runs_its_tool_to_the_end(scripted):
    result = Runner.run_sync(agent(scripted), "What is the weather in Paris?")
    assert result.final_output == "Sunny in Paris"


def test_a_streamed_agent_runs_its_tool_to_the_end(scripted):
    async def run() -> tuple[str, list[str]]:
        result = Runner.run_streamed(agent(scripted), "What is the weather in Paris?")
        kinds = [event.type async for event in result.stream_events()]
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert final == "Sunny in Paris" and "raw_response_event" in kinds
