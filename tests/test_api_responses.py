"""OpenAI's Responses API (/v1/responses) against a real `twistd -n krafla`, driven by the openai
Python client (whose own types parse every reply and event) and by the OpenAI Agents SDK with its
default Responses model; and the bounded store of responses (krafla_twisted.api.responses.ResponseStore).

Two servers, one per model: SmolLM2 for text, streaming, structured output and the store;
Qwen2.5-Coder with its qwen template for tool calls.
"""

import asyncio
import json

import httpx2
import jsonschema
import pytest

from krafla_twisted.api.responses import ResponseStore
from tests.support.fake_backend import APIHarness
from tests.support.real_models import real_model
from tests.support.server import ServerProcess

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You answer in one short sentence."
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}


class ResponseStoreTests:
    """The store keeps at most a count of responses and a byte budget of their JSON, dropping the oldest."""

    def test_count_bound_drops_the_oldest(self):
        store = ResponseStore(max_count=3, max_bytes=10**6)
        for n in range(5):
            assert store.put(f"resp_{n}", {"n": n}, ({"role": "user", "content": str(n)},))
        assert len(store) == 3
        assert [store.get(f"resp_{n}") is None for n in range(5)] == [True, True, False, False, False]
        assert store.get("resp_4").response == {"n": 4}
        assert store.get("resp_4").conversation == ({"role": "user", "content": "4"},)

    def test_byte_budget_drops_the_oldest(self):
        size = len(json.dumps([{"text": "x" * 100}, [], []]).encode())  # response, conversation, input items
        store = ResponseStore(max_count=100, max_bytes=size * 2 + size // 2)
        for n in range(4):
            store.put(f"resp_{n}", {"text": "x" * 100}, ())
            assert store.bytes <= store.max_bytes
        assert len(store) == 2 and "resp_3" in store and "resp_2" in store and "resp_1" not in store
        assert store.bytes == 2 * size

    def test_too_large_is_not_kept(self):
        store = ResponseStore(max_count=10, max_bytes=50)
        store.put("resp_small", {}, ())
        assert not store.put("resp_big", {"text": "y" * 100}, ())
        assert "resp_big" not in store and "resp_small" in store

    def test_delete_and_replace(self):
        store = ResponseStore(max_count=10, max_bytes=10**6)
        store.put("resp_a", {"v": 1}, ())
        store.put("resp_a", {"v": 22}, ())
        assert len(store) == 1 and store.get("resp_a").response == {"v": 22}
        assert store.bytes == len(json.dumps([{"v": 22}, [], []]).encode())
        assert store.delete("resp_a") and not store.delete("resp_a")
        assert len(store) == 0 and store.bytes == 0 and store.get("resp_a") is None


def named_events(body):
    """[(event name, data payload)] of a typed SSE body; every block must have both lines."""
    out = []
    for block in body.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        out.append((name_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out


class InMemoryTests:
    """The HTTP layer over the scripted backend (tests/support/fake_backend.py): the wire format of the
    events, and the failures that can only travel as events once a stream started."""

    def stream(self, harness, body):
        response, raw = harness.fetch("POST", "/v1/responses", dict(body, stream=True))
        assert response.code == 200
        assert response.headers.getRawHeaders("content-type") == ["text/event-stream; charset=utf-8"]
        return named_events(raw)

    def test_wire_format(self):
        """`event: NAME` equals the data's type, sequence numbers count from 0, no [DONE]; the
        pieces are the backend's; the response is stored and GET returns the completed one."""
        harness = APIHarness()
        events = self.stream(harness, {"input": "Hi"})
        assert all(name == data["type"] for name, data in events)
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert [d["delta"] for n, d in events if n == "response.output_text.delta"] == list(harness.backend.pieces)
        final = events[-1][1]["response"]
        assert events[-1][0] == "response.completed" and final["output"][0]["content"][0]["text"] == "Hello, world!"
        response, raw = harness.fetch("GET", f"/v1/responses/{final['id']}")
        assert response.code == 200 and json.loads(raw) == final
        response, raw = harness.fetch("GET", f"/responses/{final['id']}/input_items")
        listed = json.loads(raw)
        assert response.code == 200 and listed["object"] == "list" and listed["has_more"] is False
        assert [item["role"] for item in listed["data"]] == ["user"]
        assert listed["first_id"] == listed["last_id"] == listed["data"][0]["id"]
        response, raw = harness.fetch("GET", f"/responses/{final['id']}/input_items/more")
        assert response.code == 404 and json.loads(raw)["error"]["type"] == "invalid_request_error"

    def test_failure_after_start_is_response_failed(self):
        """An engine failure after the first piece ends the stream with response.failed, the error
        in the response object; the next request is answered."""
        harness = APIHarness()

        def explode(index):
            if index == 1:
                raise RuntimeError("out of memory")

        harness.backend.after_piece = explode
        events = self.stream(harness, {"input": "Hi"})
        names = [name for name, _ in events]
        assert names == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                         "response.failed"]
        failed = events[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert "out of memory" in failed["error"]["message"]
        harness.backend.after_piece = lambda index: None
        response, raw = harness.fetch("POST", "/v1/responses", {"input": "Hi"})
        assert response.code == 200 and json.loads(raw)["status"] == "completed"

    def test_shutdown_mid_stream(self):
        """SIGTERM during a stream: response.failed with server_shutting_down, and the stream ends."""
        harness = APIHarness()
        harness.backend.after_piece = lambda index: harness.api.shutdown() if index == 1 else None
        events = self.stream(harness, {"input": "Hi"})
        assert events[-1][0] == "response.failed"
        assert events[-1][1]["response"]["error"]["code"] == "server_shutting_down"

    def test_errors_before_start_are_http_errors(self):
        """A prompt over the context is a 400 before any event, its param named as Responses names it."""
        harness = APIHarness()
        for stream in (False, True):
            response, raw = harness.fetch("POST", "/v1/responses", {"input": "word " * 100, "stream": stream})
            assert response.code == 400
            error = json.loads(raw)["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "input"


@pytest.fixture(scope="module")
def smollm():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2",
                             "--parallel", "2"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def qwen():
    model = real_model("qwen2.5-coder-0.5b")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2",
                             "--parallel", "1"]).start()
    yield process
    process.stop()


def client_of(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


def chat_text(server, messages, **fields):
    reply = client_of(server).chat.completions.create(model="local", messages=messages, temperature=0, **fields)
    return reply.choices[0].message.content, reply


class PlainTests:
    def test_create_matches_chat_completions(self, smollm):
        """responses.create with instructions and a string input is the chat of a system and a user
        message: at temperature 0 the same text and the same prompt token count."""
        client = client_of(smollm)
        response = client.responses.create(model="local", instructions=INSTRUCTIONS, input=QUESTION,
                                           max_output_tokens=40, temperature=0, metadata={"test": "plain"})
        text, chat = chat_text(smollm, [{"role": "system", "content": INSTRUCTIONS},
                                        {"role": "user", "content": QUESTION}], max_tokens=40)
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.output_text == text and "Paris" in text
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        assert response.usage.output_tokens == chat.usage.completion_tokens
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        assert response.usage.output_tokens_details.reasoning_tokens == 0
        message = response.output[0]
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.content[0].type == "output_text" and message.content[0].annotations == []
        assert response.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
        assert response.instructions == INSTRUCTIONS and response.metadata == {"test": "plain"}
        assert response.max_output_tokens == 40 and response.temperature == 0 and response.store is True

    def test_input_items_and_max_output_tokens(self, smollm):
        """A list of message items with input_text parts is the same conversation; a reply cut by
        max_output_tokens is `incomplete` with reason max_output_tokens."""
        client = client_of(smollm)
        items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
                 {"role": "user", "content": [{"type": "input_text", "text": "What is the capital"},
                                              {"type": "input_text", "text": " of France?"}]}]
        listed = client.responses.create(model="local", input=items, max_output_tokens=40, temperature=0)
        plain = client.responses.create(model="local", instructions=INSTRUCTIONS, input=QUESTION,
                                        max_output_tokens=40, temperature=0)
        assert listed.output_text == plain.output_text
        cut = client.responses.create(model="local", input=QUESTION, max_output_tokens=2, temperature=0)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
        assert cut.usage.output_tokens == 2

        # GET /v1/responses/{id}/input_items: the input as items with ids, newest first by default
        page = client.responses.input_items.list(listed.id)
        assert [(item.type, item.role) for item in page.data] == [("message", "user"), ("message", "developer")]
        assert [part.text for part in page.data[0].content] == ["What is the capital", " of France?"]
        assert page.data[1].content[0].type == "input_text" and page.data[1].content[0].text == INSTRUCTIONS
        assert all(item.id.startswith("msg_") for item in page.data) and page.has_more is False
        first = client.responses.input_items.list(listed.id, order="asc", limit=1)
        assert first.data[0].role == "developer" and first.has_more is True
        rest = client.responses.input_items.list(listed.id, order="asc", after=first.data[0].id)
        assert [item.id for item in rest.data] == [page.data[0].id] and rest.has_more is False
        string = client.responses.input_items.list(plain.id).data
        assert [(item.role, item.content[0].type, item.content[0].text) for item in string] == \
            [("user", "input_text", QUESTION)]
        for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_nope", "after")):
            bad = httpx2.get(smollm.url(f"/responses/{listed.id}/input_items?{query}"), timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param
        missing = httpx2.get(smollm.url("/responses/resp_nope/input_items"), timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


class StreamTests:
    def test_stream_events_equal_plain(self, smollm):
        """stream=True: typed events in OpenAI's order, sequence_number counting up from 0, deltas that
        join to the non-streamed text, and a final response equal to the non-streamed one."""
        client = client_of(smollm)
        fields = dict(model="local", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=40, temperature=0)
        plain = client.responses.create(**fields)
        events = list(client.responses.create(stream=True, **fields))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        final = "response.completed" if plain.status == "completed" else "response.incomplete"
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                         "response.output_text.done", "response.content_part.done", "response.output_item.done",
                         final]
        assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
        assert "".join(d.delta for d in deltas) == plain.output_text
        assert all(d.item_id == events[-1].response.output[0].id for d in deltas)
        assert events[-4].text == plain.output_text
        done = events[-1].response
        assert done.output_text == plain.output_text and done.status == plain.status
        assert done.usage.output_tokens == plain.usage.output_tokens

    def test_stream_helper_final_response(self, smollm):
        """client.responses.stream accumulates the events itself: its final response's text is the
        non-streamed one."""
        client = client_of(smollm)
        fields = dict(model="local", input="Say hello.", max_output_tokens=200, temperature=0)
        plain = client.responses.create(**fields)
        assert plain.status == "completed"
        with client.responses.stream(**fields) as stream:
            pieces = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert final.output_text == "".join(pieces) == plain.output_text

    def test_async_stream(self, smollm):
        """AsyncOpenAI's stream gives the same text."""
        from openai import AsyncOpenAI

        fields = dict(model="local", input=QUESTION, max_output_tokens=24, temperature=0)
        plain = client_of(smollm).responses.create(**fields)

        async def run():
            client = AsyncOpenAI(base_url=smollm.base_url, api_key="none", max_retries=0)
            stream = await client.responses.create(stream=True, **fields)
            text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
            await client.close()
            return text

        assert asyncio.run(run()) == plain.output_text


class ConversationTests:
    def test_previous_response_id_continues(self, smollm):
        """previous_response_id puts the earlier input and output before the new input: the reply is
        the chat of the whole conversation, and the prompt's start comes from the KV cache."""
        client = client_of(smollm)
        first = client.responses.create(model="local", input="My name is Ada.", max_output_tokens=24, temperature=0)
        second = client.responses.create(model="local", previous_response_id=first.id, input="What is my name?",
                                         max_output_tokens=24, temperature=0)
        text, chat = chat_text(smollm, [{"role": "user", "content": "My name is Ada."},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": "What is my name?"}], max_tokens=24)
        assert second.output_text == text
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens > 0

    def test_instructions_are_not_carried_over(self, smollm):
        """As OpenAI's: a continuation keeps the earlier input and output, not the earlier instructions."""
        client = client_of(smollm)
        first = client.responses.create(model="local", instructions="You speak like a pirate.", input="Hello!",
                                        max_output_tokens=16, temperature=0)
        second = client.responses.create(model="local", previous_response_id=first.id, input="Who are you?",
                                         max_output_tokens=16, temperature=0)
        text, _ = chat_text(smollm, [{"role": "user", "content": "Hello!"},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "Who are you?"}], max_tokens=16)
        assert second.output_text == text and second.instructions is None

    def test_retrieve_and_delete(self, smollm):
        """GET returns the stored response; DELETE removes it; both are 404 afterwards; store=false is not kept."""
        import openai

        client = client_of(smollm)
        kept = client.responses.create(model="local", input="Hi", max_output_tokens=4, temperature=0)
        again = client.responses.retrieve(kept.id)
        assert again.id == kept.id and again.output_text == kept.output_text and again.usage == kept.usage
        deleted = httpx2.delete(smollm.url(f"/responses/{kept.id}"), timeout=60)
        assert deleted.status_code == 200
        assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(kept.id)
        unkept = client.responses.create(model="local", input="Hi", max_output_tokens=4, store=False)
        assert unkept.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)

    def test_unknown_previous_response(self, smollm):
        """An unknown previous_response_id is a 404 in OpenAI's shape naming the field."""
        import openai

        with pytest.raises(openai.NotFoundError) as caught:
            client_of(smollm).responses.create(model="local", input="Hi", previous_response_id="resp_nothing")
        assert caught.value.param == "previous_response_id"
        assert caught.value.body["type"] == "invalid_request_error"


class StructuredTests:
    def test_json_schema(self, smollm):
        """text.format json_schema: the reply is JSON valid against the schema (checked by jsonschema)."""
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                  "properties": {"name": {"type": "string", "maxLength": 20},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
        response = client_of(smollm).responses.create(
            model="local", input="Give a person as JSON.", max_output_tokens=60, temperature=0,
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema" and response.text.format.name == "person"


class LogprobsTests:
    def test_output_text_logprobs_are_the_chats(self, smollm):
        """include message.output_text.logprobs with top_logprobs gives each output token's log probability and
        alternatives, those of the same chat on /v1/chat/completions; streamed, the deltas carry them token by
        token and output_text.done all of them; without include, none."""
        client = client_of(smollm)
        fields = dict(model="local", input=QUESTION, max_output_tokens=12, temperature=0, top_logprobs=3,
                      include=["message.output_text.logprobs"])
        response = client.responses.create(**fields)
        _, chat = chat_text(smollm, [{"role": "user", "content": QUESTION}], max_tokens=12, logprobs=True,
                            top_logprobs=3)
        def spelled(entries):
            return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]
        expected = spelled(chat.choices[0].logprobs.content)
        assert spelled(response.output[0].content[0].logprobs) == expected and len(expected[0][2]) == 3
        assert "".join(e.token for e in response.output[0].content[0].logprobs) == response.output_text
        events = list(client.responses.create(stream=True, **fields))
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert spelled([entry for e in deltas for entry in e.logprobs]) == expected
        (done,) = [e for e in events if e.type == "response.output_text.done"]
        assert spelled(done.logprobs) == expected
        plain = client.responses.create(model="local", input=QUESTION, max_output_tokens=12, temperature=0,
                                        include=["reasoning.encrypted_content"])
        assert plain.output[0].content[0].logprobs == [] and plain.output_text == response.output_text


class ErrorTests:
    @pytest.mark.parametrize("fields, param", [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "function", "name": "missing"}, "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"include": "message.output_text.logprobs"}, "include"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ])
    def test_bad_request(self, smollm, fields, param):
        """Unsupported or invalid fields are 400s in OpenAI's shape naming the field; the server keeps serving."""
        import openai

        request = {"model": "local", "input": "Hi", "max_output_tokens": 4, **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            client_of(smollm).responses.create(**request)
        assert caught.value.param == param, caught.value.body
        assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["message"]
        assert client_of(smollm).responses.create(model="local", input="Hi", max_output_tokens=2).status

    def test_reasoning_is_ignored(self, smollm):
        """`reasoning` is accepted and has no effect."""
        client = client_of(smollm)
        fields = dict(model="local", input=QUESTION, max_output_tokens=12, temperature=0)
        assert client.responses.create(reasoning={"effort": "low"}, **fields).output_text == \
            client.responses.create(**fields).output_text


class ToolTests:
    def test_function_call_round_trip(self, qwen):
        """A required function tool gives a function_call item with JSON arguments; its output sent back
        as function_call_output gets a text answer, the same as the chat completion of that conversation."""
        client = client_of(qwen)
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.responses.create(model="local", input=question, tools=[WEATHER_TOOL], tool_choice="required",
                                        max_output_tokens=60, temperature=0)
        calls = [item for item in first.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
        assert calls[0].id.startswith("fc_") and calls[0].status == "completed"
        arguments = json.loads(calls[0].arguments)
        jsonschema.validate(arguments, WEATHER_TOOL["parameters"])
        assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

        followup = question + [calls[0].model_dump(exclude_none=True),
                               {"type": "function_call_output", "call_id": calls[0].call_id,
                                "output": "18 degrees and sunny"}]
        second = client.responses.create(model="local", input=followup, tools=[WEATHER_TOOL],
                                         max_output_tokens=40, temperature=0)
        chat_tool = {"type": "function",
                     "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}
        said = {"role": "assistant", "content": "", "tool_calls": [{
            "id": calls[0].call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": calls[0].arguments}}]}
        result = {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 degrees and sunny"}
        text, _ = chat_text(qwen, [question[0], said, result], tools=[chat_tool], max_tokens=40)
        assert second.output_text == text and text

    def test_streamed_call_equals_plain(self, qwen):
        """A streamed function call: output_item.added, arguments delta and done, output_item.done, and
        the final response's call equal to the non-streamed one; then a continuation by
        previous_response_id reuses the cache."""
        client = client_of(qwen)
        fields = dict(model="local", input="What is the weather in Rome?", tools=[WEATHER_TOOL],
                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0)
        plain = client.responses.create(**fields)
        events = list(client.responses.create(stream=True, **fields))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]
        call, streamed = plain.output[0], events[-1].response.output[0]
        assert call.type == streamed.type == "function_call"
        assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
        assert events[3].delta == events[4].arguments == call.arguments and events[4].name == "get_weather"
        answer = client.responses.create(model="local", previous_response_id=events[-1].response.id,
                                         input=[{"type": "function_call_output", "call_id": streamed.call_id,
                                                 "output": "25 degrees"}],
                                         tools=[WEATHER_TOOL], max_output_tokens=30, temperature=0)
        assert answer.output_text and answer.usage.input_tokens_details.cached_tokens > 0

    def test_agents_sdk(self, qwen):
        """The OpenAI Agents SDK with its default Responses model runs an agent that calls a function
        tool and answers with its result; Runner.run_streamed (the SDK reading our events) ends with
        the same answer."""
        from openai import AsyncOpenAI
        from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

        set_tracing_disabled(True)
        asked = []

        @function_tool
        def get_weather(city: str) -> str:
            """The current weather in a city."""
            asked.append(city)
            return f"It is 18 degrees and sunny in {city}."

        client = AsyncOpenAI(base_url=qwen.base_url, api_key="none", max_retries=0)
        agent = Agent(name="weather", instructions="You answer questions about the weather with the tool.",
                      tools=[get_weather], model=OpenAIResponsesModel(model="local", openai_client=client),
                      model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=60))
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
        assert asked and "Paris" in asked[0]
        assert isinstance(result.final_output, str) and result.final_output.strip()
        assert any(item.type == "tool_call_output_item" for item in result.new_items)

        async def streamed():
            run = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            kinds = [event.type async for event in run.stream_events()]
            return run.final_output, kinds

        final, kinds = asyncio.run(streamed())
        assert final == result.final_output and "raw_response_event" in kinds  # streamed as the SDK reads events
        assert len(asked) == 2
