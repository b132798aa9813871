"""Structured output, tool calls, log probabilities and logit_bias with the real SmolLM2 model.

The server runs SmolLM2's weights with the qwen template (SmolLM2's own template has no tool
format; the grammar makes even this small model's calls parse). The openai Python client drives
it; replies are checked with jsonschema against the schema they were asked for. Log
probabilities and reproducibility are checked in-process against the engine's own logits.
"""

import json
import math

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from krafla_twisted.api.backend import Backend
from krafla_twisted.api.schema import parse_chat_request, parse_completion_request
from krafla_twisted.cli import startup
from krafla_twisted.generation import grammar
from tests.strategies import json_schemas
from tests.support.real_models import real_model
from tests.support.server import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model():
    return real_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(model):
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def backend(model):
    runtime = startup.load_runtime({"model": str(model.mlb), "tokenizer": str(model.mlt), "chat": "qwen",
                                    "threads": 2})
    yield Backend(runtime, model_id="smollm2")
    runtime.close()


def schema_format(schema, name="reply"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


class StructuredOutputTests:
    @settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(schema=json_schemas())
    def test_reply_validates_against_schema(self, client, schema):
        """Every hypothesis-made schema within the supported subset: the reply ends by itself
        (finish_reason stop, the value complete) and validates against the schema."""
        reply = client.chat.completions.create(model="local", messages=[{"role": "user", "content": "Answer in JSON."}],
                                               response_format=schema_format(schema), max_tokens=400, temperature=0.7,
                                               seed=3)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)

    def test_json_object(self, client):
        """json_object: the reply is one JSON object."""
        reply = client.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Describe Paris as a JSON object with two keys."}],
            response_format={"type": "json_object"}, max_tokens=200, seed=1, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content), dict)

    def test_streamed_equals_whole(self, client):
        """A streamed constrained reply joins to the non-streamed one (same seed)."""
        arguments = dict(model="local", messages=[{"role": "user", "content": "A person, as JSON."}],
                         response_format=schema_format(PERSON), max_tokens=100, temperature=0.9, seed=11)
        whole = client.chat.completions.create(**arguments).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **arguments)
                  if c.choices]
        assert "".join(pieces) == whole
        jsonschema.validate(json.loads(whole), PERSON)

    @pytest.mark.parametrize("schema, fragment", [
        ({"type": "object", "if": {"type": "object"}, "then": {}}, "if"),
        ({"type": "wizard"}, "wizard"),
        ({"$ref": "#/$defs/missing"}, "missing"),
    ])
    def test_unsupported_or_invalid_schema_is_a_400(self, client, schema, fragment):
        """An unsupported feature or an invalid schema gets a 400 on response_format naming it."""
        import openai

        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="local", messages=ASK_WEATHER, response_format=schema_format(schema),
                                           max_tokens=20)
        error = caught.value.body
        assert error["param"] == "response_format" and fragment in error["message"]

    def test_hostile_schemas_end(self, client):
        """Deep nesting, a huge enum, a recursive schema, a pathological pattern: each gets a 400 or a
        complete reply within the client's timeout, and the server answers the next request."""
        import openai

        def nested(levels):
            schema = {"type": "string", "maxLength": 3}
            for _ in range(levels):
                schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
            return schema

        # 12 levels fit the body's nesting limit and reach the grammar; 20 are refused with the body.
        hostile = [nested(12), nested(20), {"enum": [f"value{i}" for i in range(20000)]},
                   {"type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False},
                   {"type": "string", "pattern": "^(a|aa|aaa)*b{1,1000}c{1,1000}$"}]
        for schema in hostile:
            try:
                reply = client.chat.completions.create(model="local", messages=ASK_WEATHER, max_tokens=120,
                                                       response_format=schema_format(schema), timeout=120)
            except openai.BadRequestError as e:
                assert e.body["param"] in ("response_format", None) and e.body["message"]
                continue
            if reply.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert client.chat.completions.create(model="local", messages=ASK_WEATHER, max_tokens=2).choices


class ToolCallTests:
    def test_required_call_round_trips(self, client):
        """tool_choice required: a parsed call with an id and JSON arguments valid for the tool,
        finish_reason tool_calls; the call and its result go back in a second turn, which answers."""
        first = client.chat.completions.create(model="local", messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                               tool_choice="required", max_tokens=100, seed=5)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        second = client.chat.completions.create(
            model="local", tools=[WEATHER, TIME], max_tokens=30, seed=5,
            messages=ASK_WEATHER + [choice.message.model_dump(exclude_none=True),
                                    {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
        assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert second.usage.prompt_tokens > first.usage.prompt_tokens

    def test_call_ids_follow_the_conversation(self, client):
        """A call's id is a hash of the request and the call: the same request gets the same id,
        streamed or not; the next turn (its messages differ) a different one."""
        ask = dict(model="local", messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
                   temperature=0)
        first = client.chat.completions.create(**ask).choices[0].message
        again = client.chat.completions.create(**ask).choices[0].message
        assert [c.id for c in again.tool_calls] == [c.id for c in first.tool_calls]
        streamed = [d for chunk in client.chat.completions.create(stream=True, **ask) if chunk.choices
                    for d in chunk.choices[0].delta.tool_calls or ()]
        assert [d.id for d in streamed if d.id] == [c.id for c in first.tool_calls]
        call = first.tool_calls[0]
        later = dict(ask, messages=ASK_WEATHER + [first.model_dump(exclude_none=True),
                                                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}])
        following = client.chat.completions.create(**later).choices[0].message
        assert following.tool_calls[0].id != call.id and following.tool_calls[0].id.startswith("call_")

    def test_named_function(self, client):
        """A named tool_choice calls exactly that function."""
        reply = client.chat.completions.create(model="local", messages=ASK_WEATHER, tools=[WEATHER, TIME],
                                               tool_choice={"type": "function", "function": {"name": "get_time"}},
                                               max_tokens=200, temperature=0)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]

    def test_parallel_calls(self, client):
        """parallel_tool_calls true lets one reply hold several calls; false (the default here) one."""
        single = client.chat.completions.create(model="local", messages=ASK_WEATHER, tools=[WEATHER],
                                                tool_choice="required", max_tokens=200, seed=2)
        assert len(single.choices[0].message.tool_calls) == 1
        several = client.chat.completions.create(model="local", tools=[WEATHER], tool_choice="required",
                                                 parallel_tool_calls=True, max_tokens=120, seed=2,
                                                 messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}])
        assert len(several.choices[0].message.tool_calls or []) >= 1

    def test_none_calls_nothing(self, client):
        """tool_choice none: no tool_calls, a plain reply."""
        reply = client.chat.completions.create(model="local", messages=ASK_WEATHER, tools=[WEATHER],
                                               tool_choice="none", max_tokens=20)
        assert reply.choices[0].message.tool_calls is None

    def test_streamed_calls_equal_whole(self, client):
        """Streamed delta.tool_calls assemble to the non-streamed calls (names and arguments), with
        finish_reason tool_calls in the last chunk."""
        arguments = dict(model="local", messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required",
                         max_tokens=100, seed=9, temperature=0.8)
        whole = client.chat.completions.create(**arguments).choices[0]
        calls, finish, content = {}, None, ""
        for chunk in client.chat.completions.create(stream=True, **arguments):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for part in delta.tool_calls or ():
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason == "tool_calls"
        assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                     for c in whole.message.tool_calls]
        assert content == (whole.message.content or "")


class LogprobTests:
    def test_chat_logprobs_are_the_engines_log_softmax(self, backend):
        """Each reply token's logprob and top_logprobs equal the log-softmax of the engine's own
        logits at that step (computed again here from Session.eval), before bias and grammar."""
        request = parse_chat_request({"messages": ASK_WEATHER, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
                                      "logit_bias": {"1": 5}, "response_format": {"type": "json_object"}, "seed": 1,
                                      "temperature": 0.8}, backend.n_vocab)
        result = backend.complete(request, on_text=None, cancelled=lambda: False)
        prompt = list(backend.prompt(request).tokens)
        backend.runtime.reset()
        session = backend.runtime.session
        logits = session.eval(prompt)
        for token, (piece, value, top) in zip(result.tokens, result.logprobs):
            reference = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
            assert piece == backend.tokenizer.token_bytes(token)
            assert math.isclose(value, reference[token], abs_tol=1e-9)
            best = np.argsort(-reference, kind="stable")[:3]
            assert [p for p, _ in top] == [backend.tokenizer.token_bytes(int(t)) for t in best]
            assert np.allclose([v for _, v in top], reference[best], atol=1e-9)
            logits = session.eval([token])
        backend.runtime.reset()

    def test_streamed_logprobs_equal_whole(self, client):
        """Chat and completions logprobs streamed chunk by chunk join to the non-streamed ones."""
        chat = dict(model="local", messages=ASK_WEATHER, max_tokens=8, logprobs=True, top_logprobs=2, temperature=0)
        whole = client.chat.completions.create(**chat).choices[0].logprobs.content
        streamed = [entry for c in client.chat.completions.create(stream=True, **chat) if c.choices and c.choices[0].logprobs
                    for entry in c.choices[0].logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
        assert len(whole) == 8 and all(len(e.top_logprobs) == 2 for e in whole)
        text = dict(model="local", prompt="The capital of France is", max_tokens=6, logprobs=2, temperature=0)
        plain = client.completions.create(**text).choices[0]
        pieces = [c.choices[0].logprobs for c in client.completions.create(stream=True, **text) if c.choices[0].logprobs]
        assert sum((p.tokens for p in pieces), []) == plain.logprobs.tokens
        assert sum((p.token_logprobs for p in pieces), []) == plain.logprobs.token_logprobs
        assert sum((p.text_offset for p in pieces), []) == plain.logprobs.text_offset
        assert "".join(plain.logprobs.tokens) == plain.text

    def test_logit_bias_is_applied(self, backend):
        """+100 on a token makes the greedy reply start with it; -100 on the greedy first token
        bans it; ids outside the vocabulary are a 400 on logit_bias."""
        from krafla_twisted.api.errors import InvalidRequest

        def first(bias):
            request = parse_completion_request({"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
                                                "logit_bias": bias}, backend.n_vocab)
            return backend.complete(request, on_text=None, cancelled=lambda: False).tokens[0]

        greedy = first({})
        assert first({"1234": 100}) == 1234
        assert first({str(greedy): -100}) != greedy
        with pytest.raises(InvalidRequest, match="logit_bias"):
            first({str(backend.n_vocab): 1})


class ReproducibilityTests:
    def test_same_seed_same_reply_with_and_without_cache(self, backend):
        """A sampled constrained reply (json_schema, temperature 0.9, a seed) and a tool call are the
        same from a cold cache, from a warm one (the same prompt again) and after a reset."""
        for body in ({"messages": ASK_WEATHER, "response_format": schema_format(PERSON)},
                     {"messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": "required"}):
            request = parse_chat_request(dict(body, max_tokens=40, temperature=0.9, seed=1234), backend.n_vocab)
            replies = []
            for reset in (True, False, True):
                if reset:
                    backend.runtime.reset()
                result = backend.complete(request, on_text=None, cancelled=lambda: False)
                replies.append((result.text, result.tokens))
            assert replies[0] == replies[1] == replies[2]
            assert backend.runtime.cached  # the warm run really had a cache to reuse


class GrammarVocabularyTests:
    def test_control_tokens_are_never_allowed_by_text(self, backend):
        """The vocabulary marks control tokens special: a JSON grammar never allows <|im_start|>."""
        vocabulary = grammar.Vocabulary.of(backend.tokenizer, backend.runtime.stop_token_ids)
        constraint = grammar.Constraint(vocabulary, grammar.json_schema_grammar({"type": "string"}))
        allowed = constraint.allowed()
        assert not allowed[backend.tokenizer.token_id("<|im_start|>")]
        assert allowed[backend.tokenizer.encode('"', add_bos=False)[0]]
