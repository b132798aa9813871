"""Ollama's API (/api/*) against a real `twistd -n krafla`, driven by the clients that speak it: the
`ollama` Python library (its pydantic types parse every reply) and LangChain's ChatOllama.

One server per model: SmolLM2 for everything but tool calls, Qwen2.5-Coder (whose qwen template has
a tool format) for those. Replies are compared with each other (streamed against whole, /api/chat
against /v1/chat/completions at temperature 0), with the model files and with jsonschema.
"""

import datetime
import json
import os

import httpx2
import jsonschema
import ollama
import pytest

from krafla_twisted import __version__
from tests.support.real_models import real_model
from tests.support.server import ServerProcess

CTX = 1024
NAME = "smollm2:135m"  # what an Ollama user types; any name is accepted with one model served
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def smollm():
    return real_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(smollm):
    process = ServerProcess([str(smollm.mlb), "-z", str(smollm.mlt), "--chat", smollm.chat, "-t", "2",
                             "--ctx", str(CTX), "--parallel", "2"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.root_url(""), timeout=300)


@pytest.fixture(scope="module")
def model_id(server):
    """The served model's id, as /v1/models (the OpenAI side) gives it."""
    return httpx2.get(server.url("/models"), timeout=60).json()["data"][0]["id"]


def post(server, path, body):
    return httpx2.post(server.root_url(path), json=body, timeout=300)


def check_final(chunk):
    """The counts of a last chunk: measured durations in nanoseconds that add up."""
    assert chunk.done is True and chunk.done_reason in ("stop", "length")
    assert chunk.prompt_eval_count > 0 and chunk.eval_count > 0
    assert chunk.prompt_eval_duration > 0 and chunk.eval_duration > 0
    assert chunk.total_duration >= chunk.prompt_eval_duration + chunk.eval_duration
    assert chunk.load_duration == 0
    created = datetime.datetime.fromisoformat(chunk.created_at)
    assert created.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 600


class OllamaChatTests:
    """/api/chat and /api/generate through the ollama library."""

    def test_chat_whole_and_streamed(self, client, model_id):
        """A whole reply is a ChatResponse with the served model's id; its stream joins to the same text and counts."""
        whole = client.chat(model=NAME, messages=MESSAGES, options=GREEDY)
        assert isinstance(whole, ollama.ChatResponse)
        assert whole.model == model_id
        assert whole.message.role == "assistant" and "Paris" in whole.message.content
        check_final(whole)
        chunks = list(client.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=True))
        assert all(not c.done for c in chunks[:-1]) and len(chunks) > 2
        assert "".join(c.message.content for c in chunks) == whole.message.content
        check_final(chunks[-1])
        assert chunks[-1].eval_count == whole.eval_count and chunks[-1].done_reason == whole.done_reason
        assert chunks[-1].prompt_eval_count == whole.prompt_eval_count

    def test_same_text_as_openai_chat(self, client, server):
        """At temperature 0 /api/chat and /v1/chat/completions give the same text and the same end for the same messages."""
        from openai import OpenAI

        messages = [{"role": "system", "content": "You answer in one short sentence."},
                    {"role": "user", "content": "Name a large animal."}]
        openai = OpenAI(base_url=server.base_url, api_key="none", max_retries=0).chat.completions.create(
            model="local", messages=messages, max_tokens=12, temperature=0)
        reply = client.chat(model=NAME, messages=messages, options={"temperature": 0, "num_predict": 12})
        assert reply.message.content == openai.choices[0].message.content
        assert reply.done_reason == openai.choices[0].finish_reason
        assert reply.eval_count == openai.usage.completion_tokens
        assert reply.prompt_eval_count == openai.usage.prompt_tokens

    def test_logprobs_are_the_openai_chats(self, client, server):
        """logprobs with top_logprobs: each token's log probability and alternatives, those of /v1/chat/completions
        for the same messages; streamed, each chunk carries its own tokens'; raw /api/generate has them too;
        top_logprobs without logprobs is a 400."""
        from openai import OpenAI

        openai = OpenAI(base_url=server.base_url, api_key="none", max_retries=0).chat.completions.create(
            model="local", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
        def spelled(entries):
            return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]
        expected = spelled(openai.choices[0].logprobs.content)
        options = {"temperature": 0, "num_predict": 8}
        reply = client.chat(model=NAME, messages=MESSAGES, logprobs=True, top_logprobs=3, options=options)
        assert spelled(reply.logprobs) == expected and len(expected[0][2]) == 3
        chunks = list(client.chat(model=NAME, messages=MESSAGES, logprobs=True, top_logprobs=3, options=options,
                                  stream=True))
        assert spelled([entry for chunk in chunks for entry in chunk.logprobs or ()]) == expected
        raw = client.generate(model=NAME, prompt="1, 2, 3,", raw=True, logprobs=True, options=options)
        assert len(raw.logprobs) == raw.eval_count and all(e.top_logprobs == [] for e in raw.logprobs)
        assert client.chat(model=NAME, messages=MESSAGES, options=options).logprobs is None
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model=NAME, messages=MESSAGES, top_logprobs=3)
        assert caught.value.status_code == 400 and "logprobs" in caught.value.error

    def test_streams_ndjson_by_default(self, server):
        """Without "stream" the reply is NDJSON: one JSON object a line, the last with Ollama's counts as integers."""
        body = {"model": NAME, "messages": MESSAGES, "options": {"temperature": 0, "num_predict": 8}}
        with httpx2.stream("POST", server.root_url("/api/chat"), json=body, timeout=300) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("application/x-ndjson")
            lines = [line for line in response.iter_lines() if line]
        chunks = [json.loads(line) for line in lines]
        assert all(set(c) == {"model", "created_at", "message", "done"} and c["done"] is False for c in chunks[:-1])
        last = chunks[-1]
        assert last["done"] is True and last["message"] == {"role": "assistant", "content": ""}
        for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                    "eval_duration"):
            assert isinstance(last[key], int) and not isinstance(last[key], bool), key
        assert last["done_reason"] == "length" and last["eval_count"] == 8

    def test_generate(self, client, server):
        """generate: whole and streamed agree; templated it equals the chat of system + prompt; raw it equals /v1/completions."""
        system = "You answer in one short sentence."
        whole = client.generate(model=NAME, prompt=QUESTION, system=system, options=GREEDY)
        assert isinstance(whole, ollama.GenerateResponse) and "Paris" in whole.response
        check_final(whole)
        streamed = list(client.generate(model=NAME, prompt=QUESTION, system=system, options=GREEDY, stream=True))
        assert "".join(c.response for c in streamed) == whole.response
        chat = client.chat(model=NAME, messages=[{"role": "system", "content": system}, *MESSAGES], options=GREEDY)
        assert chat.message.content == whole.response
        prompt = "The three primary colours are"
        raw = client.generate(model=NAME, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 10})
        text = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0}).json()
        assert raw.response == text["choices"][0]["text"] and raw.eval_count == 10

    def test_options(self, client):
        """stop ends the reply before the string; num_predict -1 runs to the end token; a seed repeats a sampled reply."""
        counting = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
        stopped = client.chat(model=NAME, messages=counting, options={"temperature": 0, "num_predict": 40, "stop": ["5"]})
        assert "5" not in stopped.message.content and "4" in stopped.message.content
        assert stopped.done_reason == "stop"
        unlimited = client.chat(model=NAME, messages=MESSAGES, options={"temperature": 0, "num_predict": -1})
        assert unlimited.done_reason == "stop" and "Paris" in unlimited.message.content
        sampled = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "seed": 7, "num_predict": 16, "repeat_penalty": 1.1,
                   "repeat_last_n": 32, "num_ctx": CTX, "num_gpu": 0, "mirostat": 0}  # the last two are ignored
        first = client.chat(model=NAME, messages=MESSAGES, options=sampled, keep_alive="5m")
        second = client.chat(model=NAME, messages=MESSAGES, options=sampled, keep_alive=0)
        assert first.message.content == second.message.content

    def test_format(self, client, server):
        """format: a JSON schema makes the reply valid for it (checked by jsonschema); "json" is /v1's json_object."""
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                  "properties": {"name": {"type": "string", "maxLength": 20},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
        messages = [{"role": "user", "content": "Give a person as JSON."}]
        reply = client.chat(model=NAME, messages=messages, format=schema, options={"temperature": 0, "num_predict": 60})
        jsonschema.validate(json.loads(reply.message.content), schema)
        streamed = list(client.chat(model=NAME, messages=messages, format=schema,
                                    options={"temperature": 0, "num_predict": 60}, stream=True))
        assert "".join(c.message.content for c in streamed) == reply.message.content
        # "json" is /v1's json_object (SmolLM2 rarely closes a free object in few tokens: compare the two).
        loose = client.chat(model=NAME, messages=messages, format="json", options={"temperature": 0, "num_predict": 30})
        openai = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 30, "temperature": 0,
                                                      "response_format": {"type": "json_object"}}).json()
        assert loose.message.content == openai["choices"][0]["message"]["content"]
        assert loose.message.content.startswith("{") and loose.message.content != reply.message.content

    def test_nothing_to_generate_loads(self, client):
        """No messages, or an empty prompt, is Ollama's way to load a model: done at once with done_reason "load"."""
        chat = client.chat(model=NAME, messages=[])
        assert chat.done and chat.done_reason == "load" and chat.message.content == ""
        generated = client.generate(model=NAME, prompt="")
        assert generated.done and generated.done_reason == "load" and generated.response == ""


class OllamaModelsTests:
    """/api/tags, /api/show, /api/ps and /api/version, checked against the model file."""

    def test_list(self, client, smollm, model_id):
        """list: the one model, with the file's size and modification time, llama family, Q4_0, about 135M parameters."""
        models = client.list().models
        assert len(models) == 1
        entry = models[0]
        assert entry.model == model_id
        assert entry.size == os.path.getsize(smollm.mlb)
        mtime = datetime.datetime.fromtimestamp(os.path.getmtime(smollm.mlb), datetime.timezone.utc)
        assert abs((entry.modified_at - mtime).total_seconds()) < 1e-3
        assert len(entry.digest) == 64 and int(entry.digest, 16) >= 0
        assert entry.details.family == "llama" and entry.details.quantization_level == "Q4_0"
        assert entry.details.parameter_size.endswith("M") and abs(float(entry.details.parameter_size[:-1]) - 135) < 1

    def test_quantization_level_is_the_file_type(self):
        """A Q4_K_M file whose first matrix is q5_0 (Qwen2.5-0.5B's rows of 896 are too short for
        super-blocks) is Q4_K_M, as Ollama says; a file converted before `file_type` was recorded
        falls back to its first matrix's type."""
        from types import SimpleNamespace

        from krafla_twisted.api.ollama import quantization_level

        assert quantization_level(SimpleNamespace(info={"file_type": "Q4_K_M"}, weight_type="q5_0")) == "Q4_K_M"
        assert quantization_level(SimpleNamespace(info={}, weight_type="q5_0")) == "Q5_0"

    def test_show(self, client, smollm):
        """show: model_info with Ollama's GGUF key names (SmolLM2-135M: 30 layers, dim 576), the parameters, the template."""
        shown = client.show(NAME)
        info = shown.modelinfo
        assert info["general.architecture"] == "llama"
        assert info["llama.block_count"] == 30 and info["llama.embedding_length"] == 576
        assert info["llama.context_length"] == 8192
        assert f"num_ctx {CTX}" in shown.parameters.splitlines()
        assert shown.template == smollm.chat
        assert "completion" in shown.capabilities
        assert shown.details.family == "llama"
        assert str(smollm.mlb) in shown.modelfile

    def test_ps_and_version(self, client, server, model_id):
        """ps: the model is loaded with the server's context; version: krafla's."""
        running = client.ps().models
        assert len(running) == 1 and running[0].model == model_id and running[0].context_length == CTX
        assert running[0].expires_at.year == 9999
        assert httpx2.get(server.root_url("/api/version"), timeout=60).json() == {"version": __version__}


class OllamaErrorsTests:
    """Bad input gets Ollama's {"error": "message"} with a 4xx status; the server keeps serving."""

    def test_bad_bodies(self, server):
        """Wrong types and values, images, templates, num_ctx above --ctx: 400 with a message naming the field."""
        chat = {"model": NAME, "messages": MESSAGES, "stream": False}
        cases = [
            ("/api/chat", {**chat, "options": {"temperature": "hot"}}, "options.temperature"),
            ("/api/chat", {**chat, "options": {"num_predict": 0}}, "options.num_predict"),
            ("/api/chat", {**chat, "options": {"num_ctx": CTX * 2}}, str(CTX)),
            ("/api/chat", {**chat, "options": {"stop": [""]}}, "options.stop"),
            ("/api/chat", {**chat, "options": [1]}, "options"),
            ("/api/chat", {**chat, "messages": "Hi"}, "messages"),
            ("/api/chat", {**chat, "messages": [{"role": "user", "content": ["Hi"]}]}, "messages[0].content"),
            ("/api/chat", {**chat, "messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
            ("/api/chat", {**chat, "messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, "images"),
            ("/api/chat", {**chat, "model": 5}, "model"),
            ("/api/chat", {**chat, "stream": "yes"}, "stream"),
            ("/api/chat", {**chat, "format": "xml"}, "format"),
            ("/api/chat", {**chat, "tools": {"name": "f"}}, "tools"),
            ("/api/generate", {"model": NAME, "prompt": "Hi", "template": "{{ .Prompt }}"}, "template"),
            ("/api/generate", {"model": NAME, "prompt": "Hi", "suffix": "end"}, "suffix"),
            ("/api/generate", {"model": NAME, "prompt": "Hi", "images": ["aGk="]}, "images"),
            ("/api/generate", {"model": NAME, "prompt": "Hi", "raw": True, "system": "Be brief."}, "system"),
            ("/api/generate", {"model": NAME, "prompt": 5}, "prompt"),
        ]
        for path, body, words in cases:
            response = post(server, path, body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()
            assert list(error) == ["error"] and isinstance(error["error"], str), error
            assert words in error["error"], (body, error)
        response = httpx2.post(server.root_url("/api/chat"), content=b"{not json", timeout=60)
        assert response.status_code == 400 and list(response.json()) == ["error"]

    def test_library_errors(self, client):
        """The library raises ResponseError with the status, plain or streamed; the server answers next."""
        with pytest.raises(ollama.ResponseError) as caught:
            client.chat(model=NAME, messages=MESSAGES, options={"num_ctx": CTX + 1})
        assert caught.value.status_code == 400 and "num_ctx" in caught.value.error
        with pytest.raises(ollama.ResponseError) as caught:
            list(client.chat(model=NAME, messages=MESSAGES, options={"temperature": -1}, stream=True))
        assert caught.value.status_code == 400 and "options.temperature" in caught.value.error
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model=NAME, prompt="Hi", context=[1, 2, 3])
        assert caught.value.status_code == 400
        with pytest.raises(ollama.ResponseError) as caught:  # found on the worker, before the stream starts
            list(client.generate(model=NAME, prompt="word " * (2 * CTX), stream=True))
        assert caught.value.status_code == 400 and f"maximum context length is {CTX} tokens" in caught.value.error
        assert "Paris" in client.chat(model=NAME, messages=MESSAGES, options=GREEDY).message.content

    def test_model_management_is_refused(self, client, server):
        """pull, push, create, copy, delete, blobs: 501 saying why; embeddings from a chat server: 400 saying why;
        unknown paths 404, wrong methods 405."""
        refusals = [lambda: client.pull(NAME), lambda: client.push(NAME), lambda: client.create(model="x", from_=NAME),
                    lambda: client.copy(NAME, "y"), lambda: client.delete(NAME)]
        for refused in refusals:
            with pytest.raises(ollama.ResponseError) as caught:
                refused()
            assert caught.value.status_code == 501 and "does not manage models over HTTP" in caught.value.error
        response = httpx2.head(server.root_url("/api/blobs/sha256:" + "0" * 64), timeout=60)
        assert response.status_code == 501
        for refused in (lambda: client.embed(model=NAME, input="Hi"), lambda: client.embeddings(model=NAME, prompt="Hi")):
            with pytest.raises(ollama.ResponseError) as caught:
                refused()
            assert caught.value.status_code == 400 and "not started for embeddings" in caught.value.error
        unknown = httpx2.get(server.root_url("/api/nothing"), timeout=60)
        assert unknown.status_code == 404 and list(unknown.json()) == ["error"]
        wrong = httpx2.get(server.root_url("/api/chat"), timeout=60)
        assert wrong.status_code == 405 and list(wrong.json()) == ["error"]
        assert client.list().models


class LangChainOllamaTests:
    """LangChain's ChatOllama (langchain-ollama) against the server."""

    def test_invoke_and_stream(self, server, client):
        """invoke's text equals the ollama library's, its usage the reply's counts; stream joins to the same text."""
        from langchain_ollama import ChatOllama

        llm = ChatOllama(model=NAME, base_url=server.root_url(""), temperature=0, num_predict=24)
        message = llm.invoke(QUESTION)
        reply = client.chat(model=NAME, messages=MESSAGES, options=GREEDY)
        assert message.content == reply.message.content
        assert message.usage_metadata["output_tokens"] == reply.eval_count
        assert message.usage_metadata["input_tokens"] == reply.prompt_eval_count
        assert message.response_metadata["done_reason"] == reply.done_reason
        assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_server():
    model = real_model("qwen2.5-coder-0.5b")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2", "--ctx", "2048",
                             "--parallel", "1"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def qwen_client(qwen_server):
    return ollama.Client(host=qwen_server.root_url(""), timeout=300)


QWEN = "qwen2.5-coder:0.5b"
TOOL_OPTIONS = {"temperature": 0, "num_predict": 80}


class OllamaToolsTests:
    """Tool calls with Qwen2.5-Coder's qwen template (a native tool format)."""

    def test_tool_call(self, qwen_client):
        """The model calls get_weather, parsed by the library into message.tool_calls (arguments an object),
        streamed the same."""
        messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        reply = qwen_client.chat(model=QWEN, messages=messages, tools=[WEATHER], options=TOOL_OPTIONS)
        chunks = list(qwen_client.chat(model=QWEN, messages=messages, tools=[WEATHER], options=TOOL_OPTIONS,
                                       stream=True))
        streamed = [call for c in chunks for call in (c.message.tool_calls or ())]
        assert "".join(c.message.content for c in chunks) == reply.message.content
        calls = reply.message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        assert "Paris" in calls[0].function.arguments["city"]
        assert reply.done_reason == "stop"
        assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
            [(c.function.name, dict(c.function.arguments)) for c in calls]

    def test_tool_result_round_trip(self, qwen_client, qwen_server):
        """An assistant call (arguments an object) and its result (tool_name) in Ollama's shape get the same answer
        as the same conversation in OpenAI's shape on /v1, and the answer uses the result."""
        from openai import OpenAI

        question = {"role": "user", "content": "What is the weather in Paris right now?"}
        call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        result = "18 degrees and sunny"
        messages = [question, ollama.Message(role="assistant", content="", tool_calls=[call]),
                    {"role": "tool", "tool_name": "get_weather", "content": result}]
        answer = qwen_client.chat(model=QWEN, messages=messages, tools=[WEATHER], options=TOOL_OPTIONS)
        assert not answer.message.tool_calls and "18" in answer.message.content
        openai = OpenAI(base_url=qwen_server.base_url, api_key="none", max_retries=0).chat.completions.create(
            model="local", tools=[WEATHER], max_tokens=80, temperature=0, messages=[
                question,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}])
        assert answer.message.content == openai.choices[0].message.content


# Qwen2.5-Coder's fill-in-the-middle format, as its model card gives it: the code before the gap, the
# code after it, then the model writes the middle.
FIM_PREFIX, FIM_SUFFIX = "def fibonacci(n):\n    ", "\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
QWEN_FIM = f"<|fim_prefix|>{FIM_PREFIX}<|fim_suffix|>{FIM_SUFFIX}<|fim_middle|>"


class FillInTheMiddleTests:
    """`suffix` on /api/generate (Ollama's insert, as code completion in editors sends it) and on /v1/completions."""

    def test_suffix_is_the_model_cards_prompt(self, qwen_client, qwen_server):
        """/api/generate with prompt and suffix gives the reply of a raw completion of Qwen2.5-Coder's own
        fill-in-the-middle prompt (its special tokens spelled out and parsed by /tokenize), token for token; so
        does /v1/completions with `suffix`, streamed or not."""
        from openai import OpenAI

        ids = [t for t in httpx2.post(qwen_server.root_url("/tokenize"), json={"content": QWEN_FIM},
                                      timeout=60).json()["tokens"]]
        assert ids[0] == 151659 and ids[-1] == 151660  # <|fim_prefix|> ... <|fim_middle|>
        options = {"temperature": 0, "num_predict": 24}
        reply = qwen_client.generate(model=QWEN, prompt=FIM_PREFIX, suffix=FIM_SUFFIX, options=options)
        client = OpenAI(base_url=qwen_server.base_url, api_key="none", max_retries=0)
        reference = client.completions.create(model="local", prompt=ids, max_tokens=24, temperature=0)
        assert reply.response == reference.choices[0].text and reply.response.strip()
        assert reply.prompt_eval_count == len(ids) == reference.usage.prompt_tokens
        inserted = client.completions.create(model="local", prompt=FIM_PREFIX, suffix=FIM_SUFFIX, max_tokens=24,
                                             temperature=0)
        assert inserted.choices[0].text == reply.response
        streamed = qwen_client.generate(model=QWEN, prompt=FIM_PREFIX, suffix=FIM_SUFFIX, options=options, stream=True)
        assert "".join(chunk.response for chunk in streamed) == reply.response

    def test_a_raw_prompt_reads_the_special_tokens_it_spells(self, qwen_client, qwen_server):
        """A client that renders the fill-in-the-middle prompt itself (Continue does, for a model whose Ollama
        template it does not know) sends QWEN_FIM as a raw prompt: its special tokens are read as those tokens,
        as Ollama and llama-server read them, so the reply is the `suffix` request's; /v1/completions the same."""
        from openai import OpenAI

        options = {"temperature": 0, "num_predict": 24}
        reply = qwen_client.generate(model=QWEN, prompt=FIM_PREFIX, suffix=FIM_SUFFIX, options=options)
        raw = qwen_client.generate(model=QWEN, prompt=QWEN_FIM, raw=True, options=options)
        assert (raw.response, raw.prompt_eval_count) == (reply.response, reply.prompt_eval_count)
        client = OpenAI(base_url=qwen_server.base_url, api_key="none", max_retries=0)
        text = client.completions.create(model="local", prompt=QWEN_FIM, max_tokens=24, temperature=0)
        assert (text.choices[0].text, text.usage.prompt_tokens) == (reply.response, reply.prompt_eval_count)

    def test_a_vocabulary_without_fill_in_the_middle_is_refused(self, client, qwen_client):
        """SmolLM2's vocabulary has no fill-in-the-middle tokens: a 400 naming `suffix`, in Ollama's shape, and
        /api/show lists no "insert" capability, which Qwen2.5-Coder's lists."""
        assert "insert" not in client.show(NAME).capabilities
        assert "insert" in qwen_client.show(QWEN).capabilities
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model=NAME, prompt="def f():", suffix="\n    return 1\n")
        assert caught.value.status_code == 400 and "fill-in-the-middle" in caught.value.error
