"""The client calls of tests/test_client_structured.py against any OpenAI-compatible server, to put
krafla and llama-server side by side on the same GGUF (docs/clients.md has the table it fills).

    .venv/bin/python bench/clients_compare.py --base-url http://127.0.0.1:8080/v1
    .venv/bin/python bench/clients_compare.py --llama-server PATH/llama-server --model qwen2.5-coder-0.5b

With --llama-server it starts `llama-server -m GGUF --jinja --port P -t 2` on the cached source GGUF
of --model (the file krafla's model is converted from) and waits for /health. Each check prints one
line, `ok` or `FAIL` and what came back; a check passes when the library returns what it was asked
for (the same condition as the test), and the line says nothing about speed.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import httpx
from pydantic import BaseModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "Name the capital of France and its country."
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER = "18 degrees and sunny"


class Capital(BaseModel):
    capital: str
    country: str


def capital(answer):
    if not (isinstance(answer, Capital) and answer.capital.strip() and answer.country.strip()):
        raise AssertionError(f"not a Capital: {answer!r}")
    return answer


def instructor_check(base_url, mode):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="none", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    return capital(client.chat.completions.create(model="local", response_model=Capital, max_retries=0,
                                                  max_tokens=60, temperature=0,
                                                  messages=[{"role": "user", "content": QUESTION}]))


def pydantic_ai_model(base_url):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("local", provider=OpenAIProvider(base_url=base_url, api_key="none"))


def pydantic_ai_output(base_url, mode):
    from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput

    output = {"tool": ToolOutput, "native": NativeOutput, "prompted": PromptedOutput}[mode](Capital)
    agent = Agent(pydantic_ai_model(base_url), output_type=output, retries=0,
                  model_settings={"max_tokens": 60, "temperature": 0})
    return capital(agent.run_sync(QUESTION).output)


def pydantic_ai_tool(base_url):
    from pydantic_ai import Agent

    agent = Agent(pydantic_ai_model(base_url), model_settings={"max_tokens": 60, "temperature": 0})
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return WEATHER

    output = agent.run_sync(WEATHER_QUESTION).output
    if not cities:
        raise AssertionError(f"the tool was not called: {output!r}")
    return cities


def agents_sdk(base_url, tool_choice):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return WEATHER

    model = OpenAIChatCompletionsModel(model="local", openai_client=AsyncOpenAI(base_url=base_url, api_key="none",
                                                                                max_retries=0))
    extra = {"tool_use_behavior": "stop_on_first_tool"} if tool_choice == "required" else {}
    agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(max_tokens=60, temperature=0, tool_choice=tool_choice), **extra)
    output = Runner.run_sync(agent, WEATHER_QUESTION, max_turns=2).final_output
    if not cities:
        raise AssertionError(f"the tool was not called: {output!r}")
    return cities


def langchain_bind_tools(base_url, tool_choice):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return WEATHER

    llm = ChatOpenAI(model="local", base_url=base_url, api_key="none", max_retries=0, temperature=0, max_tokens=60)
    message = llm.bind_tools([get_weather], tool_choice=tool_choice).invoke(WEATHER_QUESTION)
    if [call["name"] for call in message.tool_calls] != ["get_weather"]:
        raise AssertionError(f"no get_weather call: {message.content!r}")
    return message.tool_calls[0]["args"]


def smolagents_check(base_url, kind):
    from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool

    called = []

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city.

        Args:
            city: the city's name
        """
        called.append(city)
        return WEATHER

    model = OpenAIServerModel(model_id="local", api_base=base_url, api_key="none", max_tokens=60, temperature=0)
    agent_class = ToolCallingAgent if kind == "ToolCallingAgent" else CodeAgent
    agent = agent_class(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
    answer = agent.run(WEATHER_QUESTION)
    if not called or "18" not in str(answer):
        raise AssertionError(f"tool called with {called}, answer {answer!r}")
    return answer


def vercel(base_url):
    """tests/node/structured.mjs, with the npm packages of tests/node installed there first if missing."""
    node_dir = os.path.join(REPO, "tests", "node")
    if not os.path.isdir(os.path.join(node_dir, "node_modules", "@ai-sdk", "openai-compatible")):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=node_dir, check=True, timeout=600)
    result = subprocess.run(["node", "structured.mjs", base_url], cwd=node_dir, capture_output=True, text=True,
                            timeout=900)
    if result.returncode:
        raise AssertionError(result.stderr[-500:])
    out = json.loads(result.stdout)
    return {key: value if value.get("ok") else f"FAIL {value.get('error')} {value.get('text')!r}"
            for key, value in out.items()}


CHECKS = [
    ("instructor JSON", lambda url: instructor_check(url, "JSON")),
    ("instructor JSON_SCHEMA", lambda url: instructor_check(url, "JSON_SCHEMA")),
    ("instructor TOOLS", lambda url: instructor_check(url, "TOOLS")),
    ("pydantic-ai ToolOutput", lambda url: pydantic_ai_output(url, "tool")),
    ("pydantic-ai NativeOutput", lambda url: pydantic_ai_output(url, "native")),
    ("pydantic-ai PromptedOutput", lambda url: pydantic_ai_output(url, "prompted")),
    ("pydantic-ai function tool", pydantic_ai_tool),
    ("Agents SDK tool required", lambda url: agents_sdk(url, "required")),
    ("Agents SDK tool auto", lambda url: agents_sdk(url, "auto")),
    ("LangChain bind_tools named", lambda url: langchain_bind_tools(url, "get_weather")),
    ("LangChain bind_tools auto", lambda url: langchain_bind_tools(url, "auto")),
    ("smolagents ToolCallingAgent", lambda url: smolagents_check(url, "ToolCallingAgent")),
    ("smolagents CodeAgent", lambda url: smolagents_check(url, "CodeAgent")),
    ("Vercel AI SDK (structured.mjs)", vercel),
]


def start_llama_server(binary, model, port):
    from krafla_twisted.cli import models

    gguf = models.fetch_source(model, progress=False)
    process = subprocess.Popen([binary, "-m", str(gguf), "--jinja", "--port", str(port), "-t", "2", "-c", "4096"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise SystemExit("llama-server did not become healthy in 300 s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server's /v1 URL")
    parser.add_argument("--llama-server", help="start this llama-server binary on --model's GGUF")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--only", help="run only the checks whose name contains this")
    args = parser.parse_args()
    process = None
    base_url = args.base_url
    if args.llama_server:
        process = start_llama_server(args.llama_server, args.model, args.port)
        base_url = f"http://127.0.0.1:{args.port}/v1"
    if not base_url:
        parser.error("give --base-url or --llama-server")
    try:
        for name, check in CHECKS:
            if args.only and args.only not in name:
                continue
            started = time.monotonic()
            try:
                outcome = f"ok   {check(base_url)!r}"
            except Exception as e:  # every failure is a row of the table
                outcome = f"FAIL {type(e).__name__}: {e}".replace("\n", " ")
                if os.environ.get("VERBOSE"):
                    traceback.print_exc()
            print(f"{name:32} {time.monotonic() - started:6.1f} s  {outcome[:300]}", flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    sys.exit(main())
