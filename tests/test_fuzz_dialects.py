"""Fuzzing the other API dialects, bounded as tests/test_fuzz_http.py is (its BOUNDED settings, its
FailureWatch and its poison fragments, imported): hypothesis bodies into OpenAI's Responses API
(/v1/responses), Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) and Ollama's
(/api/chat, /api/generate), in memory over the scripted backend (tests/support/fake_backend.py).

A body is valid-ish (every known field drawn from values the dialect accepts), the same with one or
two fields (known or not) holding any JSON value, or any JSON object over the known names; then
sometimes a lone surrogate is put into one of its strings, or its text is cut short, spliced with a
poison fragment or given a key twice.

Properties: the status is 200 or one of the dialect's 4xx, never a 500; an error body has the
dialect's own shape (Responses: OpenAI's {"error": {message, type, param, code}}; Messages:
{"type": "error", "error": {type, message}}; Ollama: {"error": "..."}); a 200 is the dialect's reply
and reached the engine once (none for count_tokens and Ollama's "load"); a refused body never reached
the engine but to be measured against the context; nothing unhandled is logged.
"""

import gc
import json
import unittest

from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import json_values
from tests.support.fake_backend import APIHarness
from tests.test_fuzz_http import BOUNDED, POISON, FailureWatch, _splice

short_text = st.text(max_size=12)
words = st.text(min_size=1, max_size=12)
schema_object = st.just({"type": "object"}) | st.just(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def valid_or_replaced(fields, required=(), unknown=("n", "logprobs", "stream_options", "banana")):
    """Bodies over `fields` ({name: strategy of accepted values}): valid-ish ones (`required` always
    present), the same with one or two fields, known or `unknown`, set to any JSON value, and any
    JSON object over the names."""
    valid = st.fixed_dictionaries({name: fields[name] for name in required},
                                  optional={name: value for name, value in fields.items() if name not in required})
    names = st.sampled_from(sorted(fields) + list(unknown))

    @st.composite
    def replaced(draw):
        body = dict(draw(valid))
        for name in draw(st.lists(names, min_size=1, max_size=2, unique=True)):
            body[name] = draw(json_values)
        return body

    return st.one_of(valid, replaced(), st.dictionaries(names, json_values, max_size=6))


def _string_slots(value, slots):
    """(container, key, is_key) of every string in a JSON value, object keys too, depth first."""
    items = list(value.items()) if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(value, dict):
            slots.append((value, key, True))
        if isinstance(item, str):
            slots.append((value, key, False))
        else:
            _string_slots(item, slots)
    return slots


@st.composite
def as_bytes(draw, bodies):
    """A drawn body's JSON text, sometimes cut short, spliced with a poison fragment, with a key
    repeated, or with a lone surrogate (which JSON can escape) put into one of its strings."""
    body = json.loads(json.dumps(draw(bodies)))  # a copy: st.just values are shared between examples
    operation = draw(st.sampled_from(["surrogate", "none", "splice", "none", "truncate", "duplicate", "surrogate"]))
    slots = _string_slots(body, []) if operation == "surrogate" else []
    if slots:
        container, key, is_key = draw(st.sampled_from(slots))
        text = key if is_key else container[key]
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["\ud800", "\udfff"])) + text[at:]
        if is_key:
            container[text] = container.pop(key)
        else:
            container[key] = text
    text = json.dumps(body)
    if operation == "splice":
        text = _splice(text, draw(st.integers(0, len(text))), draw(POISON))
    elif operation == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif operation == "duplicate" and body:
        key = draw(st.sampled_from(sorted(body)))
        text = text[:-1] + ", " + json.dumps(key) + ": " + json.dumps(body[key]) + "}"
    return text.encode("utf-8", "surrogatepass")


# -- OpenAI's Responses API

_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "text"]),
                                         "text": short_text}), max_size=2)
_message_item = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": short_text | _parts},
    optional={"type": st.just("message")})
_call_item = st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                                    "name": st.sampled_from(["f", "g"]),
                                    "arguments": st.sampled_from(["{}", '{"city": "Paris"}', ""])})
_output_item = st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"),
                                      "output": short_text | _parts})
RESPONSES_FIELDS = {
    "model": st.sampled_from(["local", "gpt-4o"]),
    "input": short_text | st.lists(_message_item | _call_item | _output_item | st.just({"type": "reasoning"}),
                                   min_size=1, max_size=3),
    "instructions": short_text,
    "max_output_tokens": st.integers(1, 50),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 100),
    "seed": st.integers(0, 2**64 - 1),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.none() | st.none() | st.just("resp_missing"),  # null: none; the id is a 404
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
                                            optional={"parameters": schema_object, "description": short_text,
                                                      "strict": st.booleans()}), max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "parallel_tool_calls": st.booleans(),
    "text": st.fixed_dictionaries({}, optional={"format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {"type": "object"}}]),
        "verbosity": st.sampled_from(["low", "medium"])}),
    "metadata": st.dictionaries(st.text(max_size=8), short_text, max_size=3),
    "truncation": st.sampled_from(["auto", "disabled"]),
    "reasoning": st.just({"effort": "low"}),
    "user": short_text,
    "background": st.just(False),
}
responses_bodies = valid_or_replaced(RESPONSES_FIELDS, required=("input",),
                                     unknown=("conversation", "prompt", "n", "banana"))

# -- Anthropic's Messages API

_text_block = st.fixed_dictionaries({"type": st.just("text"), "text": short_text})
_user_content = short_text | st.lists(_text_block | st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1")},
    optional={"content": short_text | st.lists(_text_block, max_size=2), "is_error": st.booleans()}),
    min_size=1, max_size=3)
_assistant_content = short_text | st.lists(_text_block | st.fixed_dictionaries(
    {"type": st.just("tool_use"), "id": st.just("toolu_1"), "name": st.sampled_from(["f", "g"]),
     "input": st.just({}) | st.just({"city": "Paris"})}) | st.just({"type": "thinking", "thinking": "hm"}),
    min_size=1, max_size=3)
MESSAGES_FIELDS = {
    "model": st.sampled_from(["local", "claude-sonnet-4-5"]),
    "max_tokens": st.integers(1, 50),
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _user_content})
                         | st.fixed_dictionaries({"role": st.just("assistant"), "content": _assistant_content}),
                         min_size=1, max_size=3),
    "system": short_text | st.lists(_text_block, max_size=2),
    "stop_sequences": st.lists(words, max_size=4),
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 100),
    "stream": st.booleans(),
    "metadata": st.fixed_dictionaries({}, optional={"user_id": short_text}),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "input_schema": schema_object},
                                            optional={"description": short_text, "type": st.just("custom")}),
                      max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                         optional={"name": st.sampled_from(["f", "g"]),
                                                   "disable_parallel_tool_use": st.booleans()}),
}
messages_bodies = valid_or_replaced(MESSAGES_FIELDS, required=("max_tokens", "messages"))

# -- Ollama's API

_options = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
    "seed": st.integers(-1, 2**32), "num_predict": st.integers(-2, 50), "stop": st.lists(words, max_size=4),
    "repeat_penalty": st.floats(0.5, 2), "repeat_last_n": st.integers(-1, 64), "num_ctx": st.integers(1, 128),
    "mirostat": st.integers(0, 2)})


@st.composite
def _ollama_options(draw):
    """Options as above, one of them sometimes any JSON value."""
    options = dict(draw(_options))
    if draw(st.booleans()):
        options[draw(st.sampled_from(["temperature", "num_predict", "seed", "stop", "num_ctx", "top_k"]))] = \
            draw(json_values)
    return options


_ollama_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": short_text},
    optional={"tool_name": st.sampled_from(["f", "g"]), "images": st.just([]) | st.just(["aGk="]),
              "tool_calls": st.just([{"function": {"name": "f", "arguments": {"city": "Paris"}}}])})
_ollama_common = {
    "model": st.sampled_from(["smollm2", "llama3.2:latest"]),
    "stream": st.booleans(),
    "format": st.sampled_from(["json", "", {"type": "object"}]),
    "options": _ollama_options(),
    "keep_alive": st.sampled_from(["5m", 0, -1]),
}
OLLAMA_CHAT_FIELDS = {
    **_ollama_common,
    "messages": st.lists(_ollama_message, max_size=3),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"]), "parameters": schema_object})}), max_size=2),
}
OLLAMA_GENERATE_FIELDS = {
    **_ollama_common,
    "prompt": short_text,
    "system": short_text,
    "raw": st.booleans(),
    "template": st.just("") | short_text,
    "suffix": st.just("") | short_text,
    "images": st.just([]) | st.just(["aGk="]),
    "context": st.just([]) | st.just([1, 2, 3]),
}
ollama_chat_bodies = valid_or_replaced(OLLAMA_CHAT_FIELDS, required=("messages",))
ollama_generate_bodies = valid_or_replaced(OLLAMA_GENERATE_FIELDS, required=("prompt",))


def completions(backend):
    """How many completions the backend was asked for (count_tokens' prompts and decoding are not)."""
    return sum(1 for call in backend.calls if not isinstance(call, tuple))


def sse_names(body):
    """The `event:` names of a typed SSE body, in order."""
    return [line[len("event: "):] for line in body.decode("utf-8").split("\n") if line.startswith("event: ")]


class DialectFuzz:
    """What the three dialects' fuzz tests share: post a body, check the status, the engine calls,
    the log, and the body's shape (`check_error` and `check_reply`, per dialect)."""

    statuses = {200, 400}

    def post(self, path, raw):
        harness = self.harness
        before = completions(harness.backend)
        with FailureWatch() as watch:
            response, body = harness.fetch("POST", path, raw)
            # an error left in a Deferred is logged when the Deferred is collected; this request's objects are
            # young, so the two youngest generations hold them (a full collection here costs seconds per
            # example once the suite's heap has grown)
            gc.collect(1)
        case = (path, raw[:300], body[:300])
        self.assertEqual(watch.failures, [], case)
        self.assertIn(response.code, self.statuses, case)
        calls = completions(harness.backend) - before
        if response.code == 200:
            self.assertLessEqual(calls, 1, case)
            self.check_reply(path, response, body, calls, case)
        else:
            error = json.loads(body)
            self.check_error(response.code, error, case)
            if calls:  # only a prompt measured against the context reaches the engine to be refused
                self.assertEqual(calls, 1, case)
                self.assertIn("context", json.dumps(error), case)

    def content_type(self, response):
        return (response.headers.getRawHeaders("content-type") or [""])[0]


class ResponsesFuzzTests(DialectFuzz, unittest.TestCase):
    """POST /v1/responses."""

    harness = APIHarness()
    statuses = {200, 400, 404}   # 404: a previous_response_id that is not stored

    def check_error(self, status, error, case):
        self.assertEqual(set(error), {"error"}, case)
        self.assertEqual(set(error["error"]), {"message", "type", "param", "code"}, case)
        self.assertEqual(error["error"]["type"], "invalid_request_error", case)
        self.assertIsInstance(error["error"]["message"], str, case)
        if status == 404:
            self.assertEqual(error["error"]["code"], "previous_response_not_found", case)

    def check_reply(self, path, response, body, calls, case):
        self.assertEqual(calls, 1, case)
        if self.content_type(response).startswith("text/event-stream"):
            names = sse_names(body)
            self.assertEqual(names[0], "response.created", case)
            self.assertIn(names[-1], ("response.completed", "response.incomplete"), case)
        else:
            reply = json.loads(body)
            self.assertEqual(reply["object"], "response", case)
            self.assertIn(reply["status"], ("completed", "incomplete"), case)

    @BOUNDED
    @given(as_bytes(responses_bodies))
    def test_any_body(self, raw):
        self.post("/v1/responses", raw)


class MessagesFuzzTests(DialectFuzz, unittest.TestCase):
    """POST /v1/messages and /v1/messages/count_tokens."""

    harness = APIHarness()

    def check_error(self, status, error, case):
        self.assertEqual(set(error), {"type", "error"}, case)
        self.assertEqual(error["type"], "error", case)
        self.assertEqual(set(error["error"]), {"type", "message"}, case)
        self.assertEqual(error["error"]["type"], "invalid_request_error", case)
        self.assertIsInstance(error["error"]["message"], str, case)

    def check_reply(self, path, response, body, calls, case):
        if path.endswith("/count_tokens"):
            self.assertEqual(calls, 0, case)
            reply = json.loads(body)
            self.assertEqual(set(reply), {"input_tokens"}, case)
            self.assertIsInstance(reply["input_tokens"], int, case)
            return
        self.assertEqual(calls, 1, case)
        if self.content_type(response).startswith("text/event-stream"):
            names = sse_names(body)
            self.assertEqual(names[:2], ["message_start", "ping"], case)
            self.assertEqual(names[-2:], ["message_delta", "message_stop"], case)
        else:
            reply = json.loads(body)
            self.assertEqual((reply["type"], reply["role"]), ("message", "assistant"), case)
            self.assertIn(reply["stop_reason"], ("end_turn", "max_tokens", "stop_sequence", "tool_use"), case)

    @BOUNDED
    @given(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), as_bytes(messages_bodies))
    def test_any_body(self, path, raw):
        self.post(path, raw)


class OllamaFuzzTests(DialectFuzz, unittest.TestCase):
    """POST /api/chat and /api/generate."""

    harness = APIHarness()

    def check_error(self, status, error, case):
        self.assertEqual(set(error), {"error"}, case)
        self.assertIsInstance(error["error"], str, case)

    def check_reply(self, path, response, body, calls, case):
        lines = [json.loads(line) for line in body.decode("utf-8").split("\n") if line.strip()]
        self.assertTrue(lines, case)
        last = lines[-1]
        self.assertIs(last["done"], True, case)
        self.assertTrue(all(line["done"] is False for line in lines[:-1]), case)
        self.assertEqual(calls, 0 if last["done_reason"] == "load" else 1, case)
        key = "message" if path == "/api/chat" else "response"
        self.assertTrue(all(key in line for line in lines), case)

    @BOUNDED
    @given(st.sampled_from(["/api/chat", "/api/generate"]).flatmap(lambda path: st.tuples(
        st.just(path), as_bytes(ollama_chat_bodies if path == "/api/chat" else ollama_generate_bodies))))
    def test_any_body(self, case):
        path, raw = case
        self.post(path, raw)


class HarnessAnswersTests(unittest.TestCase):
    """The scripted backend answers every fuzzed endpoint (so a 200 is reachable in the properties above)."""

    def test_valid_bodies(self):
        harness = APIHarness()
        cases = [
            ("/v1/responses", {"input": "Hi"}),
            ("/v1/responses", {"input": "Hi", "stream": True}),
            ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}),
            ("/v1/messages", {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}),
            ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi there"}]}),
            ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}]}),
            ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
            ("/api/generate", {"prompt": "Hi"}),
        ]
        for path, body in cases:
            response, raw = harness.fetch("POST", path, body)
            self.assertEqual(response.code, 200, (path, body, raw))
        response, raw = harness.fetch("POST", "/v1/messages/count_tokens",
                                      {"messages": [{"role": "user", "content": "Hi there"}]})
        self.assertEqual(json.loads(raw), {"input_tokens": 3})


class EchoedStringsTests(unittest.TestCase):
    """Fields a Responses reply echoes without reading them (metadata, user, reasoning, text.verbosity):
    a lone surrogate there (JSON can escape one) is a 400 before the engine or a reply that can be
    written, never a request left unanswered."""

    def test_lone_surrogates(self):
        bodies = {
            "metadata value": {"metadata": {"a": "\ud800"}},
            "metadata key": {"metadata": {"\ud800": "a"}},
            "user": {"user": "\ud800"},
            "reasoning": {"reasoning": {"effort": "\ud800"}},
            "text.verbosity": {"text": {"verbosity": "\ud800"}},
            "previous_response_id": {"previous_response_id": "\ud800resp_missing"},  # echoed in the 404
            # not echoed, but kept with the stored response for GET .../input_items
            "input item key": {"input": [{"content": "", "role": "user", "\ud800type": "message"}]},
        }
        for name, fields in bodies.items():
            with self.subTest(name):
                harness = APIHarness()
                with FailureWatch() as watch:
                    try:
                        response, body = harness.fetch("POST", "/v1/responses", json.dumps({"input": "Hi", **fields}))
                    except AssertionError as e:
                        self.fail(f"{name}: no answer ({e})")
                    finally:
                        gc.collect()
                self.assertEqual(watch.failures, [], name)
                self.assertIn(response.code, (200, 400, 404), name)
                json.loads(body)
