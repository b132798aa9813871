"""Tool calls without a model: the qwen, llama3 and gpt-oss (harmony) renderings of tools, calls and
tool results against the official Jinja templates (tests/data/templates: Qwen/Qwen2.5-7B-Instruct,
Qwen/Qwen3.5-4B and openai/gpt-oss-20b, Apache-2.0, and meta-llama/Llama-3.1-8B-Instruct, Llama 3.1
Community License, all from their Hugging Face repositories), the parsers against the renderings, the grammars against the parsers, and the
streamed split of content and calls.
"""

import json
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.chat import templates
from krafla_twisted.generation import grammar, tools
from tests.strategies import tool_arguments, tool_conversations, tool_lists
from tests.support.byte_grammar import accepts
from tests.test_chat import jinja_environment

TEMPLATES = pathlib.Path(__file__).parent / "data" / "templates"
OFFICIAL = {
    "qwen": ("Qwen-Qwen2.5-7B-Instruct.jinja", {}),
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct.jinja", {"bos_token": "<|begin_of_text|>"}),
    "qwen3.5": ("Qwen3.5-4B.jinja", {}),
    "qwen3.5-nothink": ("Qwen3.5-4B.jinja", {"enable_thinking": False}),
}


@pytest.fixture(scope="module")
def official():
    env = jinja_environment()
    return {name: (env.from_string((TEMPLATES / file).read_text()), variables) for name, (file, variables) in OFFICIAL.items()}


def jinja_messages(messages):
    """The conversation as Hugging Face's templates take it: arguments as objects, not JSON text."""
    out = []
    for message in messages:
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                       "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in message["tool_calls"]]
        out.append(message)
    return out


class OfficialToolRenderingTests:
    @pytest.mark.parametrize("name", list(OFFICIAL))
    @settings(max_examples=80, deadline=None)
    @given(data=st.data())
    def test_text_equals_jinja(self, official, name, data):
        """Tools in the prompt, assistant calls and tool results render as the official template
        writes them (Llama 3.1: one call per assistant message, as its template demands)."""
        tool_list = data.draw(tool_lists())
        messages = data.draw(tool_conversations(tool_list, parallel=name != "llama3"))
        template, variables = official[name]
        expected = template.render(messages=jinja_messages(messages), tools=tool_list or None,
                                   add_generation_prompt=True, **variables)
        assert templates.get_template(name).render_text(messages, tools=tool_list or None) == expected

    @pytest.mark.parametrize("name", ["smollm", "chatml", "gemma", "llama2", "zephyr", "mistral", "phi3"])
    def test_templates_without_a_tool_format_use_the_generic_one(self, name):
        """A template with no native tool format writes tools in the generic form (tests/test_generic_tools.py)."""
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        text = templates.get_template(name).render_text([{"role": "user", "content": "hi"}], tools=[tool])
        assert templates.generic_tools_text([tool]) in text


harmony_leaf = st.one_of(
    st.just({"type": "string"}), st.just({"type": "string", "nullable": True}), st.just({"type": "number"}),
    st.just({"type": "integer"}), st.just({"type": "boolean"}), st.just({"type": ["string", "number"]}),
    st.lists(st.sampled_from(["c", "f", "k é"]), min_size=1, max_size=3, unique=True).map(
        lambda values: {"type": "string", "enum": values}),
    st.just({"type": "array"}), st.just({"type": "object"}))
harmony_schemas = st.recursive(harmony_leaf, lambda inner: st.one_of(
    inner.map(lambda items: {"type": "array", "items": items}),
    st.dictionaries(st.sampled_from(["a", "b_c", "d"]), inner, min_size=1, max_size=3).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {"type": "object", "properties": properties, "required": required}))), max_leaves=6)


@st.composite
def harmony_tools(draw):
    """Tools as gpt-oss's template takes them: every tool and parameter described (the official
    template fails on a missing description), parameters of every schema kind its type writer
    handles, some with defaults."""
    out = []
    for name in draw(st.lists(st.sampled_from(["get_weather", "lookup", "now"]), unique=True, max_size=3)):
        properties = {}
        for parameter in draw(st.lists(st.sampled_from(["city", "units", "days", "opts"]), unique=True, max_size=3)):
            spec = dict(draw(harmony_schemas), description=draw(st.sampled_from(["The city", "Which ones", "é"])))
            if draw(st.booleans()):
                spec["default"] = draw(st.integers(0, 9) | st.sampled_from(["c", None, True]))
            properties[parameter] = spec
        parameters = {"type": "object", "properties": properties,
                      "required": draw(st.lists(st.sampled_from(sorted(properties) or ["x"]), unique=True))}
        out.append({"type": "function", "function": {"name": name, "description": draw(st.sampled_from(
            ["Get the weather", "Look it up"])), "parameters": parameters}})
    return out


@pytest.fixture(scope="module")
def harmony_official():
    return jinja_environment().from_string((TEMPLATES / "openai-gpt-oss-20b.jinja").read_text())


class HarmonyToolRenderingTests:
    """gpt-oss's tools, calls and results against its official template (tests/data/templates/
    openai-gpt-oss-20b.jinja, Apache-2.0, from openai/gpt-oss-20b's chat_template.jinja)."""

    @settings(max_examples=150, deadline=None)
    @given(data=st.data())
    def test_text_equals_jinja(self, harmony_official, data):
        """The developer message's `functions` namespace (every schema kind), assistant calls (one
        per message, as the template takes them; the analysis before a call), tool results as
        JSON strings from functions.NAME: the official template's text."""
        tool_list = data.draw(harmony_tools())
        messages = data.draw(tool_conversations(tool_list, parallel=False))
        if messages[0]["role"] != "system" and data.draw(st.booleans()):
            messages.insert(0, {"role": data.draw(st.sampled_from(["system", "developer"])), "content": "Be brief."})
        expected = harmony_official.render(messages=jinja_messages(messages), tools=tool_list or None,
                                   add_generation_prompt=True)
        assert templates.get_template("gpt-oss").render_text(messages, tools=tool_list or None) == expected

    def test_required_call_grammar_has_no_think_block(self):
        """gpt-oss's required-call grammar is the call alone, thinking template or not: its reasoning
        is a channel, not a `</think>` block, and one call ends the reply."""
        fmt = tools.FORMATS["harmony"]
        tool_list = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert fmt.grammar(tool_list, thinking=True) == fmt.grammar(tool_list, parallel=False)
        assert "</think>" not in fmt.grammar(tool_list, thinking=True)

    def test_refusals_match_the_template(self):
        """What the official template refuses, krafla refuses with a ChatError: a tool result with
        no call before it, harmony channel tags in an assistant's content."""
        template = templates.get_template("gpt-oss")
        for messages in ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}],
                         [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "<|channel|>final<|message|>x"},
                          {"role": "user", "content": "and?"}]):
            with pytest.raises(templates.ChatError):
                template.render_text(messages)


class ParseTests:
    @pytest.mark.parametrize("name", list(tools.FORMATS))
    @settings(max_examples=100, deadline=None)
    @given(data=st.data())
    def test_rendered_calls_parse_back(self, name, data):
        """What the template writes for a call is read back as the same name and arguments."""
        fmt = tools.FORMATS[name]
        count = data.draw(st.integers(1, 3)) if fmt.parallel else 1
        names = ["get_weather", "lookup", "a-b_c"]
        calls = [templates.ToolCall(data.draw(st.sampled_from(names)), data.draw(tool_arguments)) for _ in range(count)]
        tool_list = []
        if name == "qwen3.5":
            # raw values: the tool's schema says which are strings (tested with other types below)
            calls = [templates.ToolCall(c.name, {k: json.dumps(v, ensure_ascii=False) for k, v in c.arguments.items()})
                     for c in calls]
            strings = {"type": "object", "properties": {k: {"type": "string"} for k in ["city", "n", "flag", "tags", "é"]}}
            tool_list = [{"type": "function", "function": {"name": n, "parameters": strings}} for n in names]
        text = "\n".join(fmt.text(call) for call in calls)
        content, parsed = fmt.parse(text, tool_list)
        assert parsed == calls and content is None

    def test_text_that_is_no_call_stays_content(self):
        """Broken calls and plain text are content; finish_reason stays the generator's."""
        for text in ("Hello", "<tool_call>\n{not json}\n</tool_call>", '<tool_call>\n{"arguments": {}}\n</tool_call>'):
            assert tools.FORMATS["qwen"].parse(text) == (text.strip(), [])
        assert tools.FORMATS["llama3"].parse('{"name": 3}') == ('{"name": 3}', [])
        assert tools.FORMATS["qwen"].parse("Sure.\n" + templates.qwen_tool_call_text(templates.ToolCall("f", {"x": 1}))) == (
            "Sure.", [templates.ToolCall("f", {"x": 1})])


    def test_untagged_qwen_call(self):
        """A Qwen reply that is only the call's JSON, without <tool_call> tags, is that call when it names
        one of the request's tools; JSON naming another tool, with other keys, or beside text stays content."""
        weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
        qwen = tools.FORMATS["qwen"]
        call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
        assert qwen.parse(" " + call + "\n", weather) == (None, [templates.ToolCall("get_weather", {"city": "Paris"})])
        for text in ('{"name": "lookup", "arguments": {}}', '{"name": "get_weather", "arguments": {}, "x": 1}',
                     '{"name": "get_weather", "arguments": []}', call + " That is all.", "Here: " + call):
            assert qwen.parse(text, weather) == (text.strip(), [])
        assert qwen.parse(call) == (call, [])   # no tools in the request: no call

    def test_untagged_qwen_call_is_held_back_while_streaming(self):
        """A streamed Qwen reply that starts with `{` waits for the end: it may be an untagged call."""
        stream = tools.ToolStream(tools.FORMATS["qwen"])
        assert [stream.push(piece) for piece in (" ", '{"name"', ': "get_weather", "arguments": {}}')] == ["", "", ""]
        assert stream.finish(None) == ""
        stream = tools.ToolStream(tools.FORMATS["qwen"])
        assert stream.push("Hi {x}") == "Hi {x}"


class ToolStreamTests:
    @pytest.mark.parametrize("name", list(tools.FORMATS))
    @settings(max_examples=200, deadline=None)
    @given(data=st.data())
    def test_sent_pieces_join_to_the_final_content(self, name, data):
        """However the reply is cut into pieces, what is streamed before the end and the rest sent
        at the end join to exactly the content the whole reply parses to."""
        fmt = tools.FORMATS[name]
        prefix = data.draw(st.text(st.sampled_from(" \nab<{}_t"), max_size=12))
        call = fmt.text(templates.ToolCall("f", {"x": 1})) if data.draw(st.booleans()) else ""
        text = prefix + call + data.draw(st.text(st.sampled_from(" \nab"), max_size=4))
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        stream = tools.ToolStream(fmt)
        sent = "".join(stream.push(piece) for piece in pieces)
        content, _ = fmt.parse(text, [])
        assert sent + stream.finish(content) == (content or "")
        assert fmt.trigger not in sent


class Qwen35ParameterTests:
    def test_values_typed_by_the_schema(self):
        """Qwen3.5's raw parameter values are read as the tool's schema types them: strings stay text
        (even "18"), other types are JSON."""
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "code": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"},
            "ok": {"type": "boolean"}, "nothing": {"type": "null"}}}}}
        call = templates.ToolCall("f", {"city": "Paris", "code": "18", "n": 3, "tags": ["a", "b"], "ok": False, "nothing": None})
        text = tools.FORMATS["qwen3.5"].text(call)
        assert tools.FORMATS["qwen3.5"].parse(text, [tool]) == (None, [call])

    def test_grammar_with_reasoning(self):
        """In thinking mode the required-call grammar takes reasoning, then </think>, then the call."""
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "n": {"type": "integer"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}}
        fmt = tools.FORMATS["qwen3.5"]
        lark = grammar.lark_grammar(fmt.grammar([tool], thinking=True))
        call = fmt.text(templates.ToolCall("f", {"city": "Paris\nFrance", "n": 4, "unit": "C"}))
        assert accepts(lark, "Let me think.\n</think>\n\n" + call)
        assert not accepts(lark, call)
        assert not accepts(lark, "x</think>\n\n" + fmt.text(templates.ToolCall("f", {"n": 4})))


class GrammarTests:
    """The tool grammars, run by llguidance over text: what they accept parses to a call."""

    @pytest.mark.parametrize("name", list(tools.FORMATS))
    @settings(max_examples=30, deadline=None)
    @given(arguments=tool_arguments)
    def test_grammar_accepts_the_rendering(self, name, arguments):
        """The rendering of a call with any arguments matching the schema is a complete sentence of
        the required-call grammar, and a call of another function is not."""
        import llguidance

        fmt = tools.FORMATS[name]
        if name == "qwen3.5":
            # its grammar writes parameters in the schema's order and types them by the schema
            arguments = {"city": str(arguments.get("city", "x")).replace("<", "") or "x", "n": 3}
            schema = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
                      "required": ["city", "n"]}
        else:
            schema = {"type": "object"}
        tool_list = [{"type": "function", "function": {"name": "f", "parameters": schema}},
                     {"type": "function", "function": {"name": "g"}}]
        text = fmt.grammar(tool_list, only="f")
        matcher_grammar = grammar.lark_grammar(text)
        assert llguidance.LLMatcher.validate_grammar(matcher_grammar) in ("",) or \
            llguidance.LLMatcher.validate_grammar(matcher_grammar).startswith("WARNING")
        call = fmt.text(templates.ToolCall("f", arguments))
        other = fmt.text(templates.ToolCall("g", arguments))
        if name == "harmony":  # a gpt-oss reply continues the generation prompt, `<|start|>assistant`
            call = call[len(templates.HARMONY_GENERATION_PROMPT):]
            other = other[len(templates.HARMONY_GENERATION_PROMPT):]
        assert accepts(matcher_grammar, call)
        assert not accepts(matcher_grammar, other)


