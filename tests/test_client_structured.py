"""Structured output and tools as the client libraries use them, each library in its own default
way against a real `twistd krafla` (docs/clients.md has the table): instructor's JSON, JSON_SCHEMA
and TOOLS modes; pydantic-ai's tool, native and prompted output and a function tool; the OpenAI
Agents SDK with a tool; LangChain's bind_tools; smolagents' ToolCallingAgent and CodeAgent; the
Vercel AI SDK (tests/node/structured.mjs). The served models are the default one,
Qwen2.5-Coder-0.5B with its `qwen` template, and SmolLM2-135M with its own `smollm` template (which
has no tool format: the generic one serves it). What the libraries return is checked by their own
pydantic models; then the grammar's bounds, the search for a schema in a json_object prompt, and 50
json_object replies of each model that must all close and parse.
"""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import BaseModel

from krafla_twisted.generation import grammar
from tests.support.byte_grammar import accepts
from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
QUESTION = "Name the capital of France and its country."
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER = "18 degrees and sunny"


class Capital(BaseModel):
    capital: str
    country: str


@pytest.fixture(scope="module", params=MODELS)
def served(request):
    """(model name, a running server) with the model's own chat template."""
    model = real_model(request.param)
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "-t", "2"]).start()
    yield request.param, process
    process.stop()


@pytest.fixture(scope="module")
def qwen():
    model = real_model("qwen2.5-coder-0.5b")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "-t", "2"]).start()
    yield process
    process.stop()


def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=600)


def check_capital(answer):
    assert isinstance(answer, Capital) and answer.capital.strip() and answer.country.strip()


class InstructorTests:
    @pytest.mark.parametrize("mode", ["JSON", "JSON_SCHEMA", "TOOLS"])
    def test_response_model(self, served, mode):
        """instructor's create(response_model=Capital) returns a Capital in JSON mode (json_object,
        the schema only in the system prompt: the server constrains the reply by that schema), in
        JSON_SCHEMA mode (response_format json_schema) and in TOOLS mode (a named tool, constrained)."""
        import instructor

        _, server = served
        client = instructor.from_openai(openai_client(server), mode=getattr(instructor.Mode, mode))
        check_capital(client.chat.completions.create(model="local", response_model=Capital, max_retries=0,
                                                     max_tokens=60, temperature=0,
                                                     messages=[{"role": "user", "content": QUESTION}]))


def pydantic_ai_model(server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("local", provider=OpenAIProvider(base_url=server.base_url, api_key="none"))


class PydanticAITests:
    @pytest.mark.parametrize("mode", ["tool", "native", "prompted"])
    def test_output_modes(self, served, mode):
        """An Agent's structured output in each mode returns a Capital with no retry: ToolOutput (the
        output tool, called as required), NativeOutput (json_schema) and PromptedOutput (json_object
        with the schema in the instructions, which constrains the reply)."""
        from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput

        _, server = served
        output = {"tool": ToolOutput, "native": NativeOutput, "prompted": PromptedOutput}[mode](Capital)
        agent = Agent(pydantic_ai_model(server), output_type=output, retries=0,
                      model_settings={"max_tokens": 60, "temperature": 0})
        check_capital(agent.run_sync(QUESTION).output)

    def test_function_tool(self, qwen):
        """An Agent with a function tool: Qwen2.5-Coder calls it with a city, its result goes back as
        a tool message, and the run ends with a text reply."""
        from pydantic_ai import Agent
        from pydantic_ai.messages import ToolCallPart, ToolReturnPart

        agent = Agent(pydantic_ai_model(qwen), model_settings={"max_tokens": 60, "temperature": 0})
        cities = []

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The weather now in a city."""
            cities.append(city)
            return WEATHER

        result = agent.run_sync(WEATHER_QUESTION)
        parts = [part for message in result.all_messages() for part in message.parts]
        assert [p.args_as_dict()["city"] for p in parts if isinstance(p, ToolCallPart)] == cities
        assert cities and "Paris" in cities[0]
        assert [p.content for p in parts if isinstance(p, ToolReturnPart)] == [WEATHER] * len(cities)
        assert isinstance(result.output, str)


class AgentsSDKTests:
    def test_function_tool(self, served):
        """The OpenAI Agents SDK's Chat Completions model with a function tool, tool_choice required
        and the run stopping on the tool's result: the model calls it with a city (the generic
        format on the default model, the qwen one on Qwen), and the result is the run's output."""
        from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                            set_tracing_disabled)
        from openai import AsyncOpenAI

        set_tracing_disabled(True)
        _, server = served
        cities = []

        @function_tool
        def get_weather(city: str) -> str:
            """The weather now in a city."""
            cities.append(city)
            return WEATHER

        model = OpenAIChatCompletionsModel(model="local", openai_client=AsyncOpenAI(base_url=server.base_url,
                                                                                    api_key="none", max_retries=0))
        agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(max_tokens=60, temperature=0, tool_choice="required"))
        result = Runner.run_sync(agent, WEATHER_QUESTION, max_turns=2)
        assert len(cities) == 1 and cities[0].strip()
        assert result.final_output == WEATHER

    def test_tool_chosen_by_the_model(self, qwen):
        """The same agent with tool_choice auto on Qwen2.5-Coder: the model calls the tool by itself
        and the next turn carries its result."""
        from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                            set_tracing_disabled)
        from openai import AsyncOpenAI

        set_tracing_disabled(True)
        cities = []

        @function_tool
        def get_weather(city: str) -> str:
            """The weather now in a city."""
            cities.append(city)
            return WEATHER

        model = OpenAIChatCompletionsModel(model="local", openai_client=AsyncOpenAI(base_url=qwen.base_url,
                                                                                    api_key="none", max_retries=0))
        agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(max_tokens=60, temperature=0))
        result = Runner.run_sync(agent, WEATHER_QUESTION, max_turns=2)
        assert cities and "Paris" in cities[0]
        assert isinstance(result.final_output, str)


class LangChainTests:
    def test_bind_tools(self, served):
        """ChatOpenAI.bind_tools with the tool named in tool_choice gives an AIMessage whose
        tool_calls hold that tool and a city; on Qwen2.5-Coder also with tool_choice left to the model."""
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        name, server = served

        @tool
        def get_weather(city: str) -> str:
            """The weather now in a city."""
            return WEATHER

        llm = ChatOpenAI(model="local", base_url=server.base_url, api_key="none", max_retries=0, temperature=0,
                         max_tokens=60)
        choices = ["get_weather"] + (["auto"] if name.startswith("qwen") else [])
        for choice in choices:
            message = llm.bind_tools([get_weather], tool_choice=choice).invoke(WEATHER_QUESTION)
            (call,) = message.tool_calls
            assert call["name"] == "get_weather" and call["args"]["city"].strip(), choice


def smolagents_tool():
    from smolagents import tool

    called = []

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city.

        Args:
            city: the city's name
        """
        called.append(city)
        return WEATHER

    return get_weather, called


class SmolagentsTests:
    def test_tool_calling_agent(self, qwen):
        """smolagents' ToolCallingAgent with Qwen2.5-Coder: it sends tool_choice required at every
        step (tools plus its final_answer tool) and its earlier calls, with their ids, and
        observations as text. Every step is a call of one of its tools that the agent runs (no
        parsing error), the first is get_weather for Paris, and the run ends with an answer. Which
        tool the model calls at the second step is a coin toss (the first tokens of the two names
        are 0.02 nats apart) that the call id written into the prompt tips: krafla's ids are a hash
        of the request, so the run is the same every time, and with them the model calls
        get_weather again (docs/clients.md); with random ids it called final_answer three times in four."""
        from smolagents import OpenAIServerModel, ToolCallingAgent
        from smolagents.memory import ActionStep

        get_weather, called = smolagents_tool()
        model = OpenAIServerModel(model_id="local", api_base=qwen.base_url, api_key="none", max_tokens=60,
                                  temperature=0)
        runs = []
        for _ in range(2):
            agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
            answer = agent.run(WEATHER_QUESTION)
            steps = [step for step in agent.memory.steps if isinstance(step, ActionStep)]
            assert steps[0].tool_calls[0].name == "get_weather" and called[0] == "Paris"
            for step in steps:
                assert step.error is None or "max steps" in str(step.error).lower(), step.error
                assert all(call.name in ("get_weather", "final_answer") for call in step.tool_calls or ())
            assert isinstance(answer, str) and "Paris" in answer
            runs.append([(call.id, call.name, call.arguments) for step in steps for call in step.tool_calls or ()])
        # the same conversation gets the same call ids, so the agent's second run repeats the first
        assert runs[0] == runs[1]
        assert len({call_id for call_id, _, _ in runs[0]}) == len(runs[0])

    def test_code_agent(self, qwen):
        """smolagents' CodeAgent with Qwen2.5-Coder: plain chat with stop strings; the 0.5B model
        does not write CodeAgent's <code> blocks (docs/clients.md), so the agent ends at max_steps
        with the answer its last, tool-less call writes: the test pins that every request is served
        and the loop ends with a text answer."""
        from smolagents import CodeAgent, OpenAIServerModel

        get_weather, _ = smolagents_tool()
        model = OpenAIServerModel(model_id="local", api_base=qwen.base_url, api_key="none", max_tokens=60,
                                  temperature=0)
        agent = CodeAgent(tools=[get_weather], model=model, max_steps=1, verbosity_level=0)
        answer = agent.run(WEATHER_QUESTION)
        assert isinstance(answer, str) and answer.strip()


NODE_PACKAGES = ("ai", "@ai-sdk/openai-compatible", "zod")


class VercelAISDKTests:
    def test_generate_object_and_tools(self, served):
        """tests/node/structured.mjs: generateObject with supportsStructuredOutputs (json_schema)
        returns the object; without it the provider sends json_object and leaves the schema out
        (it warns so): the default model (Qwen2.5-Coder) still writes the object the SDK's schema
        wants, SmolLM2 a JSON object that need not match it; generateText with
        toolChoice required runs the tool with a city; with auto Qwen2.5-Coder calls it by itself."""
        name, server = served
        node_dir = os.path.join(REPO, "tests", "node")
        if not all(os.path.isdir(os.path.join(node_dir, "node_modules", package)) for package in NODE_PACKAGES):
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=node_dir, check=True,
                           timeout=600)
        result = subprocess.run(["node", "structured.mjs", server.base_url], cwd=node_dir, capture_output=True,
                                text=True, timeout=900)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["object_json_schema"]["ok"], out
        check_capital(Capital(**out["object_json_schema"]["value"]))
        without = out["object_json_object"]
        if name.startswith("qwen"):
            # the default model writes the object indented, as llama-server's reply on the same file is
            assert without["ok"], without
            check_capital(Capital(**without["value"]))
        else:
            text = json.dumps(without["value"]) if without["ok"] else without["text"]
            assert isinstance(json.loads(text), dict)
        required = out["tools_required"]
        assert required["ok"], required
        (call,) = required["value"]["calls"]
        assert call["name"] == "get_weather" and required["value"]["executed"] == [call["input"]["city"]]
        assert required["value"]["results"] == [WEATHER]
        assert out["tools_auto"]["ok"], out["tools_auto"]
        if name.startswith("qwen"):
            assert out["tools_auto"]["value"]["executed"] and out["tools_auto"]["value"]["results"][0] == WEATHER


# ---------------------------------------------------------------------------------------------
# json_object on each model: 50 prompts, every reply closes before max_tokens and parses

SUBJECTS = ("Paris", "a cat", "the moon", "a bicycle", "Python", "the ocean", "a pizza", "Mozart", "a volcano",
            "the internet")
ASKS = ("Describe {} as a JSON object.", "Give three facts about {} in JSON.",
        "Return a JSON object with the name and a short description of {}.", "List the properties of {} as JSON.",
        "Answer in JSON: what is {}?")
CORPUS = tuple(ask.format(subject) for ask in ASKS for subject in SUBJECTS)


@pytest.fixture(scope="module", params=MODELS)
def corpus_server(request):
    """A server of the default model (Qwen2.5-Coder-0.5B) or of SmolLM2-135M, four slots."""
    model = real_model(request.param)
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "-t", "2", "--parallel", "4"]).start()
    yield process
    process.stop()


class JsonObjectCorpusTests:
    def test_fifty_prompts_close_and_parse(self, corpus_server):
        """json_object on 50 prompts at temperature 0 and max_tokens 40, with the default model and with
        SmolLM2-135M: every reply ends by itself (finish_reason stop, within max_tokens) and is one JSON
        object. Without the bounds and the closing tokens, 14 of these ran to max_tokens 256 inside the
        value on SmolLM2."""
        client = openai_client(corpus_server)

        def ask(prompt):
            reply = client.chat.completions.create(model="local", messages=[{"role": "user", "content": prompt}],
                                                   response_format={"type": "json_object"}, max_tokens=40,
                                                   temperature=0)
            return prompt, reply.choices[0].finish_reason, reply.usage.completion_tokens, reply.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, CORPUS))
        assert len(replies) == 50
        for prompt, finish, tokens, content in replies:
            assert finish == "stop" and tokens <= 40, (prompt, content)
            assert isinstance(json.loads(content), dict), (prompt, content)


# ---------------------------------------------------------------------------------------------
# The bounds and the schema search, without a model

def json_grammar(schema):
    return "start: value\nvalue: " + grammar.json_rule(schema)


class BoundsTests:
    @pytest.mark.parametrize("schema, fits, too_long", [
        ({"type": "string"}, json.dumps("x" * grammar.STRING_MAX_LENGTH), json.dumps("x" * (grammar.STRING_MAX_LENGTH + 1))),
        ({"type": "array", "items": {"type": "integer"}}, json.dumps([1] * grammar.ARRAY_MAX_ITEMS),
         json.dumps([1] * (grammar.ARRAY_MAX_ITEMS + 1))),
        ({"type": "object"}, json.dumps({f"k{i}": i for i in range(grammar.OBJECT_MAX_PROPERTIES)}),
         json.dumps({f"k{i}": i for i in range(grammar.OBJECT_MAX_PROPERTIES + 1)})),
        ({"type": "object"}, json.dumps({"k" * grammar.KEY_MAX_LENGTH: 1}),
         json.dumps({"k" * (grammar.KEY_MAX_LENGTH + 1): 1})),
        ({"type": "number"}, "0.123456", "0.1234567"),
        ({"type": "integer"}, str(grammar.NUMBER_LIMIT), str(grammar.NUMBER_LIMIT * 10)),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": 1, "b": 2}'),
        ({"type": "object", "properties": {}}, "{}", '{"a": 1}'),
        ({}, json.dumps({"a": {"b": 1}}), json.dumps({"a": [{"b": 1}]})),
    ])
    def test_unbounded_values_get_a_bound(self, schema, fits, too_long):
        """Where a schema sets no bound, a string, an array, a free object's keys and their number and
        length, a number's digits and an integer's size get the documented ones (docs/api.md); an
        object with properties and no additionalProperties takes only those; a free value nests at
        most FREE_VALUE_DEPTH arrays or objects."""
        assert accepts(json_grammar(schema), fits)
        assert not accepts(json_grammar(schema), too_long)

    def test_own_bounds_and_minimums_are_kept(self):
        """A schema's own maxLength, maxItems and additionalProperties stay; a minimum above a default
        bound raises the bound, so no satisfiable schema becomes unsatisfiable."""
        assert accepts(json_grammar({"type": "string", "maxLength": 500}), json.dumps("x" * 500))
        assert accepts(json_grammar({"type": "string", "minLength": 300}), json.dumps("x" * 300))
        assert accepts(json_grammar({"type": "array", "minItems": 20}), json.dumps([0] * 20))
        assert accepts(json_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                      "additionalProperties": True}), '{"a": 1, "b": "x"}')
        assert accepts(json_grammar({"type": "integer", "minimum": 10 ** 16}), str(10 ** 16 + 1))
        assert grammar.bounded({"enum": ["a" * 300]}) == {"enum": ["a" * 300]}

    def test_instructor_json_mode_prompt(self):
        """The schema instructor's JSON mode writes into the system message (its own handler builds
        the request here) is the one found, and a plain prompt, a JSON example that is no schema and
        a list of validation errors give none."""
        from instructor.v2.providers.openai.handlers import OpenAIJSONHandler

        _, request = OpenAIJSONHandler().prepare_request(Capital, {"messages": [{"role": "user", "content": QUESTION}]})
        assert request["response_format"] == {"type": "json_object"}
        texts = [m["content"] for m in request["messages"]]
        assert grammar.schema_in_texts(texts) == Capital.model_json_schema()
        assert grammar.schema_in_texts([QUESTION, 'Like {"name": "Paris"}', '[{"loc": ["capital"]}]']) is None

    def test_pydantic_ai_prompted_output_instructions(self):
        """pydantic-ai's prompted-output instructions (its own template and builder) hold the schema found."""
        from pydantic_ai._output import OutputObjectDefinition, StructuredTextOutputSchema
        from pydantic_ai.profiles import DEFAULT_PROMPTED_OUTPUT_TEMPLATE

        schema = Capital.model_json_schema()
        text = StructuredTextOutputSchema.build_instructions(
            DEFAULT_PROMPTED_OUTPUT_TEMPLATE, OutputObjectDefinition(json_schema=schema, name="Capital"))
        found = grammar.schema_in_texts(["Earlier turn", text, QUESTION])
        assert found["properties"] == schema["properties"] and found["required"] == schema["required"]

    def test_search_is_bounded(self):
        """A prompt made to be slow to search (many unclosed objects) is searched in at most
        MAX_SCHEMA_SEARCHES decodes and gives no schema."""
        hostile = '{"a": ' * 20000
        assert grammar.schema_in_texts([hostile] * 4) is None
