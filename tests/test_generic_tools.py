"""The generic tool format, for chat templates without a native one (smollm, zephyr, llama2, gemma,
chatml, mistral, phi3): the tools in the system prompt, calls and results as JSON text the template
carries, the grammar of a reply that is a text or a call, and the parser; then SmolLM2 with its own
`smollm` template and with `--chat zephyr` through a real server and the openai client.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.chat import templates
from krafla_twisted.generation import grammar, tools
from tests.strategies import tool_conversations, tool_lists
from tests.support.byte_grammar import accepts

GENERIC = tuple(name for name, template in templates.TEMPLATES.items() if template.tool_format is None)
FMT = tools.FORMATS["generic"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def call_of(name, arguments):
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


class RenderingTests:
    def test_which_templates_are_generic(self):
        """The templates that have no native format are the generic ones; the native ones stay native."""
        assert {"smollm", "zephyr", "llama2", "gemma", "chatml", "mistral", "phi3"} <= set(GENERIC)
        assert {"qwen", "llama3", "qwen3.5"}.isdisjoint(GENERIC)

    def test_smollm_rendering(self):
        """SmolLM2's template: the tool list after its default system prompt, the call as the
        assistant's content, the result as a user message naming the call."""
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [call_of("get_weather", {"city": "Paris", "unit": "C"})]},
                    {"role": "tool", "tool_call_id": "call_get_weather", "content": "18 degrees"}]
        text = templates.get_template("smollm").render_text(messages, tools=[WEATHER])
        assert text == (
            "<|im_start|>system\n" + templates.SMOLLM_SYSTEM + "\n\n" + templates.generic_tools_text([WEATHER])
            + "<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
            '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}<|im_end|>\n'
            '<|im_start|>user\n{"tool_response": {"name": "get_weather", "content": "18 degrees"}}<|im_end|>\n'
            "<|im_start|>assistant\n")
        listing = templates.generic_tools_text([WEATHER])
        assert json.dumps({"name": "get_weather", "description": "The weather in a city",
                           "parameters": WEATHER["function"]["parameters"]}) in listing

    def test_results_that_are_json_and_parallel_calls(self):
        """Several calls render as one tool_calls list; consecutive results share one user message,
        the n-th naming the n-th call; a JSON object result is written as JSON."""
        messages = [{"role": "user", "content": "Paris?"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [call_of("get_weather", {"city": "Paris", "unit": "C"}),
                                    call_of("get_time", {"zone": "CET"})]},
                    {"role": "tool", "tool_call_id": "a", "content": '{"degrees": 18}'},
                    {"role": "tool", "tool_call_id": "b", "content": "12:00"}]
        text = templates.get_template("zephyr").render_text(messages, tools=TOOLS)
        assert ('<|assistant|>\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]}</s>\n') in text
        assert ('<|user|>\n{"tool_response": {"name": "get_weather", "content": {"degrees": 18}}}\n'
                '{"tool_response": {"name": "get_time", "content": "12:00"}}</s>\n<|assistant|>\n') in text

    @pytest.mark.parametrize("name", GENERIC)
    @settings(max_examples=40, deadline=None)
    @given(data=st.data())
    def test_any_tool_conversation_renders(self, name, data):
        """Every generic template renders any conversation with tools, calls and results: the tool
        list, each call's JSON and each result are in the text, and it ends with the generation prompt."""
        tool_list = data.draw(tool_lists())
        messages = data.draw(tool_conversations(tool_list, parallel=True))
        template = templates.get_template(name)
        text = template.render_text(messages, tools=tool_list or None)
        if tool_list:
            assert templates.generic_tools_text(tool_list).strip() in text
        for message in messages:
            if message.get("tool_calls"):
                calls = [templates.ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in message["tool_calls"]]
                assert templates.generic_tool_calls_text(calls) in text
        for message in messages:
            if message["role"] == "tool":
                written = json.dumps(message["content"], ensure_ascii=False)[1:-1]
                assert written in text or message["content"].strip() in text

    def test_next_turn_starts_with_the_reply(self):
        """The prompt of the turn after a call starts with that turn's prompt and the call as the
        grammar writes it (so the KV cache is reused)."""
        template = templates.get_template("smollm")
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        call = templates.ToolCall("get_weather", {"city": "Paris", "unit": "C"})
        before = template.render_text(messages, tools=TOOLS)
        after = template.render_text(messages + [
            {"role": "assistant", "content": None, "tool_calls": [call_of(call.name, call.arguments)]},
            {"role": "tool", "tool_call_id": "x", "content": "18"}], tools=TOOLS)
        assert after.startswith(before + FMT.text(call) + "<|im_end|>")

    def test_an_assistant_call_last_is_not_continued(self):
        """A conversation ending with an assistant's call gets a generation prompt, not a continuation."""
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": [call_of("get_time", {"zone": "CET"})]}]
        assert templates.get_template("smollm").render_text(messages, tools=TOOLS).endswith(
            "}}<|im_end|>\n<|im_start|>assistant\n")


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                     | st.floats(allow_nan=False, allow_infinity=False),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)
_calls = st.builds(templates.ToolCall, _names, st.dictionaries(st.text(max_size=8), _json, max_size=4))


class ParseTests:
    @settings(max_examples=300, deadline=None)
    @given(calls=st.lists(_calls, min_size=1, max_size=4),
           prefix=st.text(st.characters(blacklist_characters="{", blacklist_categories=("Cs",)), max_size=12))
    def test_any_call_round_trips(self, calls, prefix):
        """Any calls (any names, any JSON arguments) written in the generic form parse back as the same
        calls; text before them is the content."""
        text = templates.generic_tool_calls_text(calls)
        assert FMT.parse(text, TOOLS) == (None, calls)
        content, parsed = FMT.parse(prefix + text)
        assert parsed == calls and content == (prefix.strip() or None)

    @pytest.mark.parametrize("text", [
        "Hello", '{"tool_call": 3}', '{"tool_call": {"arguments": {}}}', '{"tool_calls": []}',
        '{"tool_call": {"name": "f", "arguments": [1]}}', '{"tool_call": {"name": "f"', '{"x": 1}',
        '{"tool_call": {"name": "f", "arguments": {}}, "more": 1}'])
    def test_what_is_no_call_stays_content(self, text):
        assert FMT.parse(text) == (text.strip(), [])

    def test_streamed_text_then_call(self):
        """ToolStream sends text before the call's trigger and holds the call back."""
        stream = tools.ToolStream(FMT)
        text = 'Sure. {"tool_call": {"name": "get_time", "arguments": {"zone": "CET"}}}'
        sent = "".join(stream.push(text[i:i + 3]) for i in range(0, len(text), 3))
        content, calls = FMT.parse(text)
        assert sent == "Sure." and content == "Sure." and stream.finish(content) == ""
        assert calls == [templates.ToolCall("get_time", {"zone": "CET"})]


class GrammarTests:
    def test_required_call(self):
        """The required grammar takes a call of one of the tools with valid arguments, and nothing else;
        parallel calls only with parallel, and then two or more in the list form."""
        one = FMT.text(templates.ToolCall("get_weather", {"city": "Paris", "unit": "C"}))
        two = templates.generic_tool_calls_text([templates.ToolCall("get_weather", {"city": "Paris", "unit": "F"}),
                                                 templates.ToolCall("get_time", {"zone": "UTC"})])
        single = grammar.lark_grammar(FMT.grammar(TOOLS, parallel=False))
        parallel = grammar.lark_grammar(FMT.grammar(TOOLS, parallel=True))
        assert accepts(single, one) and not accepts(single, two)
        assert accepts(parallel, one) and accepts(parallel, two)
        for wrong in ("Hello", "", FMT.text(templates.ToolCall("get_weather", {"city": "Paris", "unit": "K"})),
                      FMT.text(templates.ToolCall("get_weather", {"city": "Paris"})),
                      FMT.text(templates.ToolCall("other", {}))):
            assert not accepts(single, wrong)
        only = grammar.lark_grammar(FMT.grammar(TOOLS, only="get_time"))
        assert not accepts(only, one) and accepts(only, FMT.text(templates.ToolCall("get_time", {"zone": "UTC"})))

    @settings(max_examples=60, deadline=None)
    @given(text=st.text(max_size=30))
    def test_text_or_call(self, text):
        """With text, any reply that does not start with `{` is allowed, and so is a call."""
        lark = grammar.lark_grammar(FMT.grammar(TOOLS, parallel=False, text=True))
        assert accepts(lark, text) == (not text.startswith("{"))
        assert accepts(lark, FMT.text(templates.ToolCall("get_time", {"zone": "CET"})))


# ---------------------------------------------------------------------------------------------
# SmolLM2 through a real server, with its own template and with zephyr


@pytest.fixture(scope="module", params=["smollm", "zephyr"])
def server(request):
    from tests.support.real_models import real_model
    from tests.support.server import ServerProcess

    model = real_model("smollm2-135m")
    assert model.chat == "smollm"
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", request.param, "-t", "2"]).start()
    yield process
    process.stop()


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


QUESTION = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]


def check_calls(message, names=("get_weather", "get_time")):
    """The message's calls: each names a tool and has arguments valid for its schema."""
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return message.tool_calls


def streamed(server, **request):
    """(content, [(name, arguments)], finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client(server).chat.completions.create(model="local", stream=True, **request):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


class ServerTests:
    def test_required_call(self, server):
        """tool_choice required: a call with schema-valid arguments, streamed equal to whole."""
        request = dict(messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
        reply = client(server).chat.completions.create(model="local", **request)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = check_calls(choice.message)
        assert streamed(server, **request) == (None, [(c.function.name, c.function.arguments) for c in calls],
                                               "tool_calls")

    def test_named_function_and_parallel_calls(self, server):
        """A named tool_choice forces that tool; parallel_tool_calls lets the reply hold several."""
        named = client(server).chat.completions.create(
            model="local", messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        check_calls(named.choices[0].message, names=("get_time",))
        several = client(server).chat.completions.create(
            model="local", messages=[{"role": "user", "content": "Weather and time in Paris?"}], tools=TOOLS,
            max_tokens=160, temperature=0, tool_choice="required", parallel_tool_calls=True)
        assert several.choices[0].finish_reason in ("tool_calls", "length")
        if several.choices[0].finish_reason == "tool_calls":
            check_calls(several.choices[0].message)

    def test_auto_gives_text_or_a_call(self, server):
        """tool_choice auto: the reply is a plain text or a valid call (never broken JSON), streamed
        equal to whole; none: plain text."""
        for messages in (QUESTION, [{"role": "user", "content": "Say hello."}]):
            request = dict(messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
            reply = client(server).chat.completions.create(model="local", **request)
            message = reply.choices[0].message
            if message.tool_calls:
                assert reply.choices[0].finish_reason == "tool_calls"
                calls = [(c.function.name, c.function.arguments) for c in check_calls(message)]
            else:
                assert message.content and not message.content.lstrip().startswith("{")
                calls = []
            assert streamed(server, **request) == (message.content, calls, reply.choices[0].finish_reason)
        none = client(server).chat.completions.create(model="local", messages=QUESTION, tools=TOOLS,
                                                      tool_choice="none", max_tokens=30, temperature=0)
        assert none.choices[0].message.tool_calls is None and none.choices[0].message.content

    def test_round_trip(self, server):
        """The call and its result go back in the next request; the reply is an answer or a call."""
        first = client(server).chat.completions.create(model="local", messages=QUESTION, tools=TOOLS,
                                                       tool_choice="required", max_tokens=80, temperature=0)
        message = first.choices[0].message
        call = check_calls(message)[0]
        messages = QUESTION + [message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        second = client(server).chat.completions.create(model="local", messages=messages, tools=TOOLS,
                                                        max_tokens=40, temperature=0)
        answer = second.choices[0]
        assert answer.finish_reason in ("stop", "length", "tool_calls")
        if answer.message.tool_calls:
            check_calls(answer.message)
        else:
            assert answer.message.content
        # the second prompt starts with the first prompt and the reply: the KV cache serves it
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
