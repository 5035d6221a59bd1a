"""One agent loop run by the OpenAI Agents SDK (``openai-agents``) against radixserve.

The SDK drives ``/v1/responses`` as it drives OpenAI's: the agent's instructions, its
function tool (schema made by the SDK, ``strict``), the first turn forced to call it
(``tool_choice="required"``; the SDK resets it to ``auto`` after a call, as it does
against OpenAI, so the loop ends), the tool run by the SDK, its output sent back with
``previous_response_id`` (the server-side conversation), and a final answer in the
agent's output type (a JSON schema: ``text.format``, constrained decoding, so the random
model's answer ends and parses). Tracing is
off (it would export to OpenAI); nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import os
from typing import Literal

import pytest
from http_helpers import AGENT_KEYS, Server
from pydantic import BaseModel

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
agents = pytest.importorskip("agents")


def test_agent_loop_with_a_function_tool(agent_server: Server) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    class Report(BaseModel):
        weather: Literal["sunny", "rainy"]

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather of a city."""
        calls.append(city)
        return "18 C, sunny"

    async def run() -> object:
        client = AsyncOpenAI(
            base_url=agent_server.url + "/v1", api_key=AGENT_KEYS[0], max_retries=0
        )
        try:
            agent = Agent(
                name="weather",
                instructions="You answer weather questions with the get_weather tool.",
                tools=[get_weather],
                output_type=Report,
                model=OpenAIResponsesModel(model="default", openai_client=client),
                model_settings=ModelSettings(
                    tool_choice="required",
                    parallel_tool_calls=False,  # one call: a random model would call on
                    max_tokens=300,
                    temperature=0,
                ),
            )
            return await Runner.run(
                agent, "Weather in Paris?", max_turns=4, auto_previous_response_id=True
            )
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1  # the forced turn called the tool once, the SDK ran it
    kinds = [item.type for item in result.new_items]  # type: ignore[attr-defined]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item"
    assert result.final_output.weather in ("sunny", "rainy")  # type: ignore[attr-defined]
    responses = result.raw_responses  # type: ignore[attr-defined]
    first, second = (r.usage for r in responses)
    assert len(responses) == 2 and second.input_tokens > first.input_tokens
    # The continued turn's prompt starts with the first one's (whole pages of it cached).
    assert second.input_tokens_details.cached_tokens >= (first.input_tokens // 4) * 4 - 4
