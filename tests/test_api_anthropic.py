"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the real `anthropic`
Python SDK against a real `twistd -n krafla` with an API key: its own types and event parsing say
whether the shapes are right, and the OpenAI endpoint of the same server says whether the
translation is exact (at temperature 0 the same conversation gives the same text). The SDK's
`messages.create` no longer takes `temperature`; the server's default (-T 0) is greedy, and the
field itself is sent once through `extra_body`.

One server: SmolLM2 with the `qwen` chat template, which has a native tool format (the grammar
makes even SmolLM2 call a tool correctly, as in tests/test_docs.py), so the tool tests do not
depend on a generic tool format.
"""

import json
import re

import httpx
import pytest

from tests.support.real_models import real_model
from tests.support.server import ServerProcess

KEY = "sk-ant-test"
SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France?"
COUNTING = "Count from 1 to 30, separated by commas: 1, 2, 3,"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                            "required": ["city"], "additionalProperties": False}}
WEATHER_QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2",
                             "--api-key", KEY]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    # The SDK appends /v1/messages to its base URL.
    with anthropic.Anthropic(base_url=server.root_url(""), api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def text_of(message):
    return "".join(block.text for block in message.content if block.type == "text")


def blocks(message):
    """What a reply says, block by block (tool_use ids differ from reply to reply)."""
    return [(block.type, block.text) if block.type == "text" else (block.type, block.name, block.input)
            for block in message.content]


def total_input(usage):
    """Every prompt token, as Anthropic counts them: new ones plus those read from the cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def assert_serving(client):
    """The server still answers a plain request."""
    reply = client.messages.create(model="local", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert reply.type == "message" and reply.usage.output_tokens >= 1


def openai_tools():
    return [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                              "parameters": WEATHER["input_schema"]}}]


class MessagesTests:
    """Plain and streamed replies, stop reasons and usage, as the SDK parses them."""

    def test_plain_message_equals_chat_completion(self, client, openai_client):
        """A message with a system prompt is a Message of one text block, with the text and token counts
        the OpenAI endpoint gives for the same conversation."""
        from anthropic.types import Message, TextBlock

        reply = client.messages.create(model="local", max_tokens=24, extra_body={"temperature": 0}, system=SYSTEM,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       metadata={"user_id": "ignored"})
        assert isinstance(reply, Message)
        assert reply.id.startswith("msg_") and reply.role == "assistant" and reply.type == "message"
        assert len(reply.content) == 1 and isinstance(reply.content[0], TextBlock)
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
        chat = openai_client.chat.completions.create(
            model="local", max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
        assert reply.content[0].text == chat.choices[0].message.content
        assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
        assert reply.usage.output_tokens == chat.usage.completion_tokens
        assert total_input(reply.usage) == chat.usage.prompt_tokens
        # A system prompt as a list of text blocks is the same system prompt.
        blocks = client.messages.create(model="local", max_tokens=24,
                                        system=[{"type": "text", "text": SYSTEM}],
                                        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
        assert text_of(blocks) == text_of(reply)

    def test_text_documents_are_read(self, client, openai_client):
        """A plain-text document block (a `text` or `content` source) is read as its title, a blank line, its
        text and a blank line, before the text that follows: the same reply and prompt tokens as that text
        sent to the OpenAI endpoint."""
        question = "What color is the sky in these notes?"
        sources = ({"type": "text", "media_type": "text/plain", "data": "The sky is green."},
                   {"type": "content", "content": [{"type": "text", "text": "The sky "}, {"type": "text", "text": "is green."}]})
        chat = openai_client.chat.completions.create(
            model="local", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": f"Notes\n\nThe sky is green.\n\n{question}"}])
        for source in sources:
            reply = client.messages.create(model="local", max_tokens=16, extra_body={"temperature": 0}, messages=[
                {"role": "user", "content": [{"type": "document", "title": "Notes", "source": source},
                                             {"type": "text", "text": question}]}])
            assert text_of(reply) == chat.choices[0].message.content
            assert total_input(reply.usage) == chat.usage.prompt_tokens

    def test_stream_equals_plain(self, client, server):
        """`messages.stream` gives Anthropic's events in order, and its final message equals the plain reply."""
        request = dict(model="local", max_tokens=20, messages=[{"role": "user", "content": QUESTION}])
        plain = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        raw = [kind for kind in kinds if kind not in ("text", "input_json")]   # the SDK's own derived events
        assert re.fullmatch(r"message_start (content_block_start (content_block_delta )+content_block_stop )?"
                            r"message_delta message_stop ", "".join(kind + " " for kind in raw)), raw
        assert blocks(final) == blocks(plain)
        assert (final.stop_reason, final.stop_sequence) == (plain.stop_reason, plain.stop_sequence)
        assert final.usage.output_tokens == plain.usage.output_tokens
        assert total_input(final.usage) == total_input(plain.usage)
        # On the wire: a ping after message_start, every event named as its data's type, no [DONE].
        with httpx.stream("POST", server.url("/messages"), json=dict(request, stream=True), timeout=300,
                          headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            body = response.read().decode()
        events = [block.split("\n") for block in body.strip().split("\n\n")]
        names = [lines[0].removeprefix("event: ") for lines in events]
        assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
        assert all(json.loads(lines[1].removeprefix("data: "))["type"] == name for name, lines in zip(names, events))
        assert "[DONE]" not in body

    def test_stop_reasons(self, client):
        """max_tokens ends with "max_tokens"; a stop sequence the reply would hold ends it right before,
        with "stop_sequence" and that sequence; streamed the same."""
        request = dict(model="local", messages=[{"role": "user", "content": COUNTING}])
        cut = client.messages.create(max_tokens=4, **request)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 4
        whole = text_of(client.messages.create(max_tokens=40, **request))
        words = re.findall(r"\w+", whole)
        assert len(words) >= 3, whole
        stop = words[2]
        stopped = client.messages.create(max_tokens=40, stop_sequences=["no such text", stop], **request)
        assert text_of(stopped) == whole[:whole.index(stop)]
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
        with client.messages.stream(max_tokens=40, stop_sequences=["no such text", stop], **request) as stream:
            streamed = stream.get_final_message()
        assert blocks(streamed) == blocks(stopped)
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)

    def test_paths_without_v1(self, server):
        """/messages and /messages/count_tokens answer without /v1 too, with Bearer or x-api-key."""
        body = {"model": "local", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        reply = httpx.post(server.root_url("/messages"), json=body, headers={"Authorization": f"Bearer {KEY}"},
                           timeout=300)
        assert reply.status_code == 200 and reply.json()["type"] == "message"
        count = httpx.post(server.root_url("/messages/count_tokens/"), json=body, headers={"x-api-key": KEY},
                           timeout=300)
        assert count.status_code == 200 and count.json()["input_tokens"] > 0


class ToolTests:
    """tool_use blocks out, tool_result blocks back in, through the template's own tool format."""

    def test_tool_round_trip(self, client, openai_client):
        """tool_choice "any" gives a tool_use block (streamed: the same call through input_json_delta);
        the tool_result turn gives the text the OpenAI endpoint gives for the same conversation."""
        from anthropic.types import ToolUseBlock

        messages = [{"role": "user", "content": WEATHER_QUESTION}]
        request = dict(model="local", max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"},
                       messages=messages)
        first = client.messages.create(**request)
        assert first.stop_reason == "tool_use"
        calls = [block for block in first.content if isinstance(block, ToolUseBlock)]
        assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
        assert isinstance(calls[0].input["city"], str) and set(calls[0].input) == {"city"}
        with client.messages.stream(**request) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use"
        assert blocks(streamed) == blocks(first)

        result = "18 degrees and sunny"
        second_messages = messages + [first.to_param(), {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": result}]}]}]
        second = client.messages.create(model="local", max_tokens=24, tools=[WEATHER],
                                        tool_choice={"type": "none"}, messages=second_messages)
        assert second.stop_reason in ("end_turn", "max_tokens") and text_of(second)
        chat = openai_client.chat.completions.create(
            model="local", max_tokens=24, temperature=0, tools=openai_tools(), tool_choice="none",
            messages=[{"role": "user", "content": WEATHER_QUESTION},
                      {"role": "assistant", "content": text_of(first) or None, "tool_calls": [
                          {"id": calls[0].id, "type": "function",
                           "function": {"name": "get_weather", "arguments": json.dumps(calls[0].input)}}]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": result}])
        assert text_of(second) == chat.choices[0].message.content
        assert total_input(second.usage) == chat.usage.prompt_tokens

    def test_named_tool_and_count(self, client):
        """tool_choice {"type": "tool", "name"} calls that tool; count_tokens of a request with tools
        equals the prompt tokens its reply used."""
        request = dict(model="local", tools=[WEATHER], messages=[{"role": "user", "content": WEATHER_QUESTION}])
        reply = client.messages.create(max_tokens=60, tool_choice={"type": "tool", "name": "get_weather"}, **request)
        assert [block.name for block in reply.content if block.type == "tool_use"] == ["get_weather"]
        count = client.messages.count_tokens(**request)
        assert count.input_tokens == total_input(reply.usage)


class CountTokensTests:
    def test_count_equals_usage(self, client):
        """count_tokens is the prompt a completion renders: every input token of the same request's reply."""
        request = dict(model="local", system=SYSTEM, messages=[
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"}])
        count = client.messages.count_tokens(**request)
        reply = client.messages.create(max_tokens=4, **request)
        assert count.input_tokens == total_input(reply.usage) > 0
        shorter = client.messages.count_tokens(model="local", messages=[{"role": "user", "content": QUESTION}])
        assert 0 < shorter.input_tokens < count.input_tokens


class AuthTests:
    """The key as `x-api-key` (what the SDK sends) or `Authorization: Bearer`, refused in Anthropic's shape."""

    def test_keys(self, server, client):
        import anthropic

        root = server.root_url("")
        assert_serving(client)   # x-api-key
        with anthropic.Anthropic(base_url=root, auth_token=KEY, api_key=None, max_retries=0) as bearer:
            assert_serving(bearer)
        with anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as raised:
                wrong.messages.create(model="local", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert raised.value.status_code == 401
        assert raised.value.body["type"] == "error"
        assert raised.value.body["error"]["type"] == "authentication_error"
        missing = httpx.post(server.url("/messages/count_tokens"), json={"messages": []}, timeout=60)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert_serving(client)

    def test_check_key_reads_x_api_key(self):
        """Access.check_key: x-api-key is read when there is no Authorization header; one of them only."""
        from twisted.web.test.requesthelper import DummyRequest

        from krafla_twisted.api.access import Access
        from krafla_twisted.api.errors import Unauthorized

        access = Access(api_key=KEY)

        def request(**headers):
            dummy = DummyRequest([b""])
            for name, value in headers.items():
                dummy.requestHeaders.addRawHeader(name.replace("_", "-").encode(), value.encode())
            return dummy

        access.check_key(request(x_api_key=KEY))
        access.check_key(request(authorization=f"Bearer {KEY}"))
        for bad in (request(), request(x_api_key="wrong"), request(x_api_key=f"Bearer {KEY}")):
            with pytest.raises(Unauthorized):
                access.check_key(bad)
        twice = request(x_api_key=KEY)
        twice.requestHeaders.addRawHeader(b"x-api-key", KEY.encode())
        with pytest.raises(Unauthorized):
            access.check_key(twice)


class ErrorTests:
    """Bad input gets a 400 in Anthropic's shape (the SDK raises BadRequestError), and the server serves on."""

    BAD = [
        ("max_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("max_tokens", {"max_tokens": "10", "messages": [{"role": "user", "content": "Hi"}]}),
        ("max_tokens", {"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}),
        ("messages", {"max_tokens": 4}),
        ("messages", {"max_tokens": 4, "messages": "Hi"}),
        ("messages.0.role", {"max_tokens": 4, "messages": [{"role": "system", "content": "Hi"}]}),
        ("messages.0.content", {"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}),
        ("messages.0.content.0.type", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "banana", "text": "Hi"}]}]}),
        ("messages.0.content.0", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}),
        ("messages.0.content.0.text", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": 7}]}]}),
        ("messages.0.content.0.source", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": ""}}]}]}),
        ("messages.0.content.0.source.data", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": 5}}]}]}),
        ("messages.0.content.0.input", {"max_tokens": 4, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": "{}"}]}]}),
        ("messages.0.content.0.tool_use_id", {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "content": "x"}]}]}),
        ("system", {"max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "Hi"}]}),
        ("temperature", {"max_tokens": 4, "temperature": "hot", "messages": [{"role": "user", "content": "Hi"}]}),
        ("top_k", {"max_tokens": 4, "top_k": 1.5, "messages": [{"role": "user", "content": "Hi"}]}),
        ("stop_sequences", {"max_tokens": 4, "stop_sequences": "x", "messages": [{"role": "user", "content": "Hi"}]}),
        ("stream", {"max_tokens": 4, "stream": "yes", "messages": [{"role": "user", "content": "Hi"}]}),
        ("tools", {"max_tokens": 4, "tools": {"name": "f"}, "messages": [{"role": "user", "content": "Hi"}]}),
        ("tools.0.input_schema", {"max_tokens": 4, "tools": [{"name": "f"}],
                                  "messages": [{"role": "user", "content": "Hi"}]}),
        ("tools.0.type", {"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                          "messages": [{"role": "user", "content": "Hi"}]}),
        ("tool_choice.type", {"max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "maybe"},
                              "messages": [{"role": "user", "content": "Hi"}]}),
        ("tool_choice.name", {"max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"},
                              "messages": [{"role": "user", "content": "Hi"}]}),
    ]

    @pytest.mark.parametrize("field, body", BAD, ids=[f"{i}-{field}" for i, (field, _) in enumerate(BAD)])
    def test_bad_request(self, client, field, body):
        """The SDK raises BadRequestError with Anthropic's error body, whose message names the field."""
        import anthropic
        from anthropic.types import Message

        with pytest.raises(anthropic.BadRequestError) as raised:
            client.post("/v1/messages", body=dict(body, model="local"), cast_to=Message)
        assert raised.value.status_code == 400
        error = raised.value.body
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
        assert_serving(client)

    def test_not_json_and_too_long(self, server, client):
        """A body that is not JSON, and a prompt over the context (plain or streamed), are 400s too."""
        import anthropic

        broken = httpx.post(server.url("/messages"), content=b"{not json", headers={"x-api-key": KEY}, timeout=60)
        assert broken.status_code == 400
        assert broken.json()["type"] == "error" and broken.json()["error"]["type"] == "invalid_request_error"
        long = [{"role": "user", "content": "word " * 10000}]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="local", max_tokens=2, messages=long)
        with pytest.raises(anthropic.BadRequestError):
            with client.messages.stream(model="local", max_tokens=2, messages=long) as stream:
                stream.get_final_message()
        assert_serving(client)

    def test_not_found_and_method(self, server, client):
        """An unknown path under /v1/messages is a 404 not_found_error, a GET a 405, both in Anthropic's shape."""
        headers = {"x-api-key": KEY}
        missing = httpx.post(server.url("/messages/nope"), json={}, headers=headers, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        deeper = httpx.post(server.url("/messages/count_tokens/nope"), json={}, headers=headers, timeout=60)
        assert deeper.status_code == 404 and deeper.json()["type"] == "error"
        wrong = httpx.get(server.url("/messages"), headers=headers, timeout=60)
        assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
        assert_serving(client)


def named_events(body):
    """(event name, data) of each event of an SSE body; the data is JSON, or the raw text when it is not."""
    out = []
    for block in body.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        try:
            data = json.loads(fields["data"])
        except ValueError:
            data = fields["data"]
        out.append((fields.get("event"), data))
    return out


class StreamErrorTests:
    """Errors once a stream has started, in memory (tests/support/fake_backend.py): an `event: error`
    in Anthropic's shape ends the stream, with no [DONE]."""

    BODY = {"model": "x", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}

    def stream_with(self, after_piece):
        from tests.support.fake_backend import APIHarness, RawConnection, split_response

        harness = APIHarness()
        harness.backend.after_piece = lambda index: after_piece(harness, index)
        connection = RawConnection(harness)
        connection.post("/v1/messages", self.BODY)
        harness.pool.run_all()
        status, headers, body = split_response(connection.output())
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        return harness, named_events(body)

    def test_engine_error_mid_stream(self):
        def explode(harness, index):
            if index == 1:
                raise RuntimeError("out of memory")

        harness, events = self.stream_with(explode)
        names = [name for name, _ in events]
        assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
        assert events[3][1]["delta"] == {"type": "text_delta", "text": "Hello"}
        assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                                   "message": "generation failed: out of memory"}})
        assert all(data != "[DONE]" for _, data in events)
        # The server serves on, in Anthropic's shape.
        harness.backend.after_piece = lambda index: None
        response, body = harness.fetch("POST", "/v1/messages", dict(self.BODY, stream=False))
        assert response.code == 200
        reply = json.loads(body)
        assert reply["content"] == [{"type": "text", "text": "Hello, world!"}] and reply["stop_reason"] == "end_turn"

    def test_shutdown_mid_stream(self):
        def stop(harness, index):
            if index == 1:
                harness.api.shutdown()

        _, events = self.stream_with(stop)
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
        assert "message_stop" not in [name for name, _ in events]


class TranslationTests:
    """The translation alone: any JSON in Anthropic's fields is a CompletionRequest or a 400, never a crash."""

    def test_arbitrary_bodies(self):
        from hypothesis import given, settings, strategies as st

        from krafla_twisted.api.anthropic import parse_messages_request
        from krafla_twisted.api.errors import InvalidRequest
        from krafla_twisted.api.schema import CompletionRequest
        from tests.strategies import json_values

        kinds = st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "banana"]) | json_values
        blocks = st.fixed_dictionaries({"type": kinds}, optional={
            "text": json_values, "id": json_values, "name": json_values, "input": json_values,
            "tool_use_id": json_values, "content": json_values | st.lists(st.fixed_dictionaries(
                {"type": st.just("text"), "text": json_values}), max_size=2), "is_error": json_values})
        messages = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | json_values}, optional={
            "content": json_values | st.text(max_size=5) | st.lists(blocks, max_size=3)})
        tools = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | json_values}, optional={
            "input_schema": json_values | st.just({"type": "object"}), "type": json_values,
            "description": json_values}), max_size=2)
        bodies = st.fixed_dictionaries({}, optional={
            "max_tokens": json_values | st.integers(1, 10), "messages": json_values | st.lists(messages, max_size=3),
            "system": json_values, "stop_sequences": json_values, "temperature": json_values,
            "top_p": json_values, "top_k": json_values, "stream": json_values, "metadata": json_values,
            "tools": json_values | tools, "model": json_values,
            "tool_choice": json_values | st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                                               optional={"name": st.sampled_from(["f", "g"])})})

        @settings(max_examples=300, deadline=None)
        @given(bodies, st.booleans())
        def check(body, count_only):
            try:
                request = parse_messages_request(body, 1000, count_only=count_only)
            except InvalidRequest as e:
                assert e.status == 400 and e.message
            else:
                assert isinstance(request, CompletionRequest) and request.kind == "chat"
                assert count_only or request.max_tokens is not None

        check()
