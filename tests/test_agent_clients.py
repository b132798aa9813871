"""Agent frameworks against a real server: instructor (JSON and TOOLS modes), pydantic-ai (a tool
and structured output), LangChain's with_structured_output (json_schema and function calling), the
openai npm package and the Vercel AI SDK (generateObject, tools), each as its documentation shows it, with SmolLM2's weights and the qwen template (which has a tool
format). What they return is checked by their own pydantic models.
"""

import json
import os
import subprocess

import pytest
from pydantic import BaseModel, Field

from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess


class City(BaseModel):
    city: str = Field(max_length=30, description="The city's name")
    country: str = Field(max_length=30, description="The country it is in")


class Capital(BaseModel):
    capital: str
    country: str


QUESTION = "Which city is the capital of France? Give its name and country."
# instructor's JSON mode only asks for a JSON object (the schema is in the prompt): these field
# names and this question are ones the 135M model fills in by itself at temperature 0.
CAPITAL_QUESTION = "Name the capital of France and its country."


@pytest.fixture(scope="module")
def server():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2"]).start()
    yield process
    process.stop()


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


class InstructorTests:
    @pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
    def test_response_model(self, server, mode):
        """instructor's create(response_model=Capital) returns a Capital in TOOLS mode (a named
        tool, constrained), JSON_SCHEMA mode (response_format json_schema) and JSON mode (json_object
        and the schema in the prompt)."""
        import instructor

        client = instructor.from_openai(openai_client(server), mode=getattr(instructor.Mode, mode))
        answer = client.chat.completions.create(model="local", response_model=Capital, max_retries=0, max_tokens=120,
                                                temperature=0, messages=[{"role": "user", "content": CAPITAL_QUESTION}])
        assert isinstance(answer, Capital) and answer.capital


class PydanticAITests:
    def agent(self, server, output_type, **kwargs):
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        model = OpenAIChatModel("local", provider=OpenAIProvider(base_url=server.base_url, api_key="none"))
        return Agent(model, output_type=output_type, model_settings={"max_tokens": 150, "temperature": 0}, **kwargs)

    def test_structured_output(self, server):
        """An Agent with output_type=City (pydantic-ai's output tool, called as required) returns a City."""
        result = self.agent(server, City).run_sync(QUESTION)
        assert isinstance(result.output, City)

    def test_tool_then_output(self, server):
        """An Agent with a tool and a structured output: every tool call the model makes is run and
        its result sent back as a tool message, and the run ends with a City."""
        from pydantic_ai.messages import ToolCallPart, ToolReturnPart

        agent = self.agent(server, City, retries=2)
        calls = []

        @agent.tool_plain
        def country_of(city: str) -> str:
            """The country a city is in."""
            calls.append(city)
            return "France"

        result = agent.run_sync(QUESTION)
        assert isinstance(result.output, City)
        parts = [part for message in result.all_messages() for part in message.parts]
        called = [p for p in parts if isinstance(p, ToolCallPart) and p.tool_name == "country_of"]
        returned = [p for p in parts if isinstance(p, ToolReturnPart) and p.tool_name == "country_of"]
        assert len(called) == len(returned) == len(calls)


class LangChainTests:
    @pytest.mark.parametrize("method", ["json_schema", "function_calling"])
    def test_with_structured_output(self, server, method):
        """ChatOpenAI.with_structured_output(City) returns a City with either method."""
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model="local", base_url=server.base_url, api_key="none", max_retries=0, temperature=0,
                         max_tokens=120)
        city = llm.with_structured_output(City, method=method).invoke(QUESTION)
        assert isinstance(city, City) and city.city


class NodeClientTests:
    """The openai npm package and the Vercel AI SDK under node (tests/node/agents.mjs)."""

    def test_openai_npm_and_ai_sdk(self, server):
        """openai npm: a json_schema reply that validates, a required call that round-trips through a
        second turn, streamed delta.tool_calls equal to the whole reply's. Vercel AI SDK:
        generateObject returns the object, generateText with a tool runs it with the parsed input."""
        import jsonschema

        node_dir = os.path.join(REPO, "tests", "node")
        if not all(os.path.isdir(os.path.join(node_dir, "node_modules", name)) for name in NODE_PACKAGES):
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=node_dir, check=True, timeout=600)
        result = subprocess.run(["node", "agents.mjs", server.base_url], cwd=node_dir, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["structured"]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["structured"]["content"]), Capital.model_json_schema())
        first = out["first"]
        assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
        (call,) = first["message"]["tool_calls"]
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
        assert out["second"]["finish_reason"] in ("stop", "length")
        assert out["second"]["prompt_tokens"] > out["second"]["first_prompt_tokens"]
        assert out["streamed"] == {"calls": [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}],
                                   "finish_reason": "tool_calls"}
        assert set(out["object"]) == {"capital", "country"}
        (ai_call,) = out["ai_tools"]["calls"]
        assert ai_call["name"] == "get_weather" and out["ai_tools"]["executed"] == [ai_call["input"]["city"]]
        assert out["ai_tools"]["results"] == ["18 degrees and sunny"]


NODE_PACKAGES = ("openai", "ai", "@ai-sdk/openai-compatible", "zod")
