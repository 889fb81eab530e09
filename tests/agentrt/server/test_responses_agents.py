"""The OpenAI Agents SDK (`openai-agents`) pointed at a real `agentrt serve`: an agent with a
function tool and a Pydantic `output_type` runs to a typed final output, through the
Responses API (`OpenAIResponsesModel`, plain and streamed) and through chat completions
(`OpenAIChatCompletionsModel`). Tracing is off: nothing leaves localhost.

The embedded 135M model does not stop calling a tool by itself: the agent asks for a call
(`tool_choice="required"`, one at a time), and the tool turns itself off once it has
answered (`is_enabled`), so the next turn can only give the answer in the output type."""

from __future__ import annotations

import openai
import pytest
from pydantic import BaseModel

from tests.agentrt.server.helpers import API_KEY

agents = pytest.importorskip("agents")

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the Agents SDK runs on asyncio


class Weather(BaseModel):
    city: str
    temperature: int


@pytest.fixture(scope="module", autouse=True)
def _no_tracing():
    agents.set_tracing_disabled(True)
    yield
    agents.set_tracing_disabled(False)


def _client(server) -> openai.AsyncOpenAI:
    """A client for one test: `async with` closes it on that test's event loop."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _weather_agent(model) -> tuple[agents.Agent, list[str]]:
    cities: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not cities)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="Look the weather up with the tool, then answer.",
        tools=[get_weather],
        output_type=Weather,
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=40
        ),
    )
    return agent, cities


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
async def test_an_agent_runs_to_a_typed_output(server, model_class):
    async with _client(server) as client:
        agent, cities = _weather_agent(getattr(agents, model_class)(MODEL, client))
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert isinstance(result.final_output, Weather)
    assert len(cities) == 1  # the tool ran once, on the model's call
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == len(outputs) == 1


async def test_a_streamed_agent_run_over_responses(server):
    async with _client(server) as client:
        agent, cities = _weather_agent(agents.OpenAIResponsesModel(MODEL, client))
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(result.final_output, Weather) and len(cities) == 1
