"""Tool calls: each chat template's own format for them, read back out of a reply, and the grammar
that makes a model write one when the request requires it.

    fmt = tools.FORMATS[template.tool_format or "generic"]   # "qwen" (Qwen2.5), "llama3" (Llama 3.1),
                                                             # "qwen3.5", "harmony" (gpt-oss);
                                                             # "generic": no native format
    grammar = fmt.grammar(request_tools, only="get_weather", parallel=False)   # Lark text for llguidance
    content, calls = fmt.parse(reply_text, request_tools)   # calls: [chat.ToolCall], content: str or None

The renderings of tools, calls and results are in krafla_twisted.chat.templates (each template writes its
own); what a model writes is parsed here with the same spellings. `ToolStream` splits a streamed
reply into content that can be sent at once and a held-back rest that may be a call.
"""

import json
import re

from krafla_twisted.chat.templates import (HARMONY_GENERATION_PROMPT, ToolCall, generic_tool_call_text,
                                           harmony_call_head, harmony_tool_call_text, llama3_tool_call_text,
                                           qwen35_tool_call_text, qwen_tool_call_text, tool_json)
from krafla_twisted.generation.grammar import json_rule


def _literal(text):
    """A Lark string literal for `text`."""
    return json.dumps(text)


def parameters_schema(tool):
    """The JSON schema of a tool's arguments (an object with no properties when it has none)."""
    schema = tool["function"].get("parameters")
    return schema if schema else {"type": "object", "properties": {}}


def tool_name(tool):
    return tool["function"]["name"]


def _arguments(value):
    return value if isinstance(value, dict) else None


class ToolFormat:
    """What the formats share: the grammar of a reply that is a call of one of the tools (each
    format writes a tool's call rule in `_call_rule`), and calls read out of a reply by a pattern
    (`_call` and `_read`)."""

    parallel = True     # whether a reply may hold several calls, one per line

    def grammar(self, tools, only=None, parallel=True, thinking=False):
        """Lark text for a reply that is a call of one of `tools` (only `only`, if given); several
        calls, a line each, with `parallel` where the format allows it; with `thinking`, reasoning
        (no `<` in it) and `</think>` come first."""
        rules = []
        names = []
        for index, tool in enumerate(tools):
            if only is not None and tool_name(tool) != only:
                continue
            rules.append(f"call{index}: {self._call_rule(index, tool, rules)}")
            names.append(f"call{index}")
        start = 'start: call ("\\n" call)*' if parallel and self.parallel else "start: call"
        if thinking:
            start = start.replace("start: ", 'start: REASONING "</think>\\n\\n" ')
            rules.append("REASONING: /[^<]*/")
        return "\n".join([start, "call: " + " | ".join(names), *rules])

    def _call_rule(self, index, tool, rules):
        """The Lark expression of a call of `tool` (adding the rules it needs to `rules`)."""
        raise NotImplementedError

    def parse(self, text, tools=()):
        """(content, calls): every match of `_call` that `_read` makes a ToolCall of is a call and
        leaves the content; the content is None when nothing but whitespace is left."""
        calls = []
        kept = []
        position = 0
        for match in self._call.finditer(text):
            call = self._read(match, tools)
            if call is None:
                continue
            kept.append(text[position:match.start()])
            position = match.end()
            calls.append(call)
        kept.append(text[position:])
        return _content("".join(kept) if calls else text), calls


def _json_call_rule(index, tool, rules, head, tail):
    """A call written as `head`, the arguments as one JSON object, `tail`."""
    rules.append(f"args{index}: {json_rule(parameters_schema(tool))}")
    return f"{_literal(head)} args{index} {_literal(tail)}"


class QwenFormat(ToolFormat):
    """Qwen2.5 (Hermes style): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one
    per call, separated by newlines. A reply that is nothing but that JSON object, untagged, naming
    one of the request's tools, is a call too: the small Qwen2.5 models often drop the tags when
    no grammar holds them to the format (an "auto" request)."""

    name = "qwen"
    trigger = "<tool_call>"
    leading = "{"   # a reply starting with it may be an untagged call: ToolStream holds it back
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

    def _call_rule(self, index, tool, rules):
        head = '<tool_call>\n{"name": "' + tool_name(tool) + '", "arguments": '
        return _json_call_rule(index, tool, rules, head, "}\n</tool_call>")

    @staticmethod
    def _read(match, tools=()):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = _arguments(value.get("arguments", {}))
        return None if arguments is None else ToolCall(value["name"], arguments)

    def parse(self, text, tools=()):
        content, calls = super().parse(text, tools)
        if calls or not text.lstrip().startswith(self.leading):
            return content, calls
        try:
            value = json.loads(text)
        except ValueError:
            return content, calls
        names = {tool_name(tool) for tool in tools}
        if (isinstance(value, dict) and set(value) == {"name", "arguments"} and value["name"] in names
                and _arguments(value["arguments"]) is not None):
            return None, [ToolCall(value["name"], value["arguments"])]
        return content, calls

    text = staticmethod(qwen_tool_call_text)


class Llama3Format(ToolFormat):
    """Llama 3.1: the whole reply is `{"name": N, "parameters": {...}}` (one call per turn)."""

    name = "llama3"
    trigger = "{"
    parallel = False

    def _call_rule(self, index, tool, rules):
        return _json_call_rule(index, tool, rules, '{"name": "' + tool_name(tool) + '", "parameters": ', "}")

    def parse(self, text, tools=()):
        stripped = text.strip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>"):].lstrip()
        try:
            value = json.loads(stripped)
        except ValueError:
            return _content(text), []
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = _arguments(value.get("parameters", value.get("arguments", {})))
            if arguments is not None:
                return None, [ToolCall(value["name"], arguments)]
        return _content(text), []

    text = staticmethod(llama3_tool_call_text)


class Qwen35Format(ToolFormat):
    """Qwen3.5 (Qwen3-Coder's XML): `<tool_call>\n<function=N>\n<parameter=K>\nVALUE\n</parameter>\n
    ...</function>\n</tool_call>`; a value is raw text for a string parameter, JSON otherwise.

    The grammar writes required parameters in the schema's order, then the optional ones, each at
    most once. A string value cannot hold `<` (the grammar's end of a value), and its maxLength or
    pattern is not enforced (an enum is); in thinking mode the reasoning before `</think>` cannot
    hold `<` either."""

    name = "qwen3.5"
    trigger = "<tool_call>"
    _call = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\s*(.*?)</function>\s*(?:</tool_call>|\Z)", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def _call_rule(self, index, tool, rules):
        schema = parameters_schema(tool)
        properties = schema.get("properties") or {}
        required = [name for name in schema.get("required", []) if name in properties]
        optional = [name for name in properties if name not in required]
        parts = []
        for number, name in enumerate(required + optional):
            rule = f"p{index}_{number}"
            value = self._value_rule(properties[name], f"{rule}_json", rules)
            rules.append(f"{rule}: {_literal('<parameter=' + name + '>' + chr(10))} {value}")
            parts.append(rule if name in required else f"{rule}?")
        head = _literal(f"<tool_call>\n<function={tool_name(tool)}>\n")
        tail = _literal("</function>\n</tool_call>")
        return f"{head} {' '.join(parts)} {tail}"

    @staticmethod
    def _value_rule(schema, json_name, rules):
        """The expression of a parameter's value and its closing tag (adding a %json rule if needed)."""
        closing = _literal("\n</parameter>\n")
        if schema.get("type") == "string" and "enum" not in schema:
            return "/([^<]*[^<\\n])?\\n<\\/parameter>\\n/"
        if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
            return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ") " + closing
        rules.append(f"{json_name}: {json_rule(schema)}")
        return f"{json_name} {closing}"

    def _read(self, match, tools=()):
        name = match.group(1).strip()
        # the parameter schemas of the named tool (the last of that name), which say which values are strings
        called = next((t for t in reversed(tools) if isinstance(t, dict) and isinstance(t.get("function"), dict)
                       and tool_name(t) == name), None)
        types = (parameters_schema(called).get("properties") or {}) if called is not None else {}
        arguments = {}
        for key, raw in self._parameter.findall(match.group(2)):
            key = key.strip()
            arguments[key] = self._value(raw, types.get(key, {}))
        return ToolCall(name, arguments)

    @staticmethod
    def _value(raw, schema):
        if schema.get("type") == "string" or (isinstance(schema.get("enum"), list)
                                              and all(isinstance(v, str) for v in schema["enum"])):
            return raw
        if raw in PYTHON_SPELLINGS:  # the template writes values through Python's str()
            return PYTHON_SPELLINGS[raw]
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    text = staticmethod(qwen35_tool_call_text)


PYTHON_SPELLINGS = {"True": True, "False": False, "None": None}


def _content(text):
    text = text.strip()
    return text or None


class GenericFormat(ToolFormat):
    """The generic form, for templates without a native one (the tools are in the system prompt as
    krafla_twisted.chat.templates.generic_tools_text writes them): a reply is plain text, or nothing
    but `{"tool_call": {"name": N, "arguments": {...}}}`, or with parallel calls
    `{"tool_calls": [{"name": N, "arguments": {...}}, ...]}` (two or more; one call is always the first
    form, as the template renders it back). The grammar with `text` lets a reply be either a text that
    does not start with `{` or a call, so even a small model's call always parses."""

    name = "generic"
    trigger = '{"tool_call'
    constrains_text = True     # an "auto" reply is constrained too: text or a call (backend.constraint)
    _decoder = json.JSONDecoder()

    def grammar(self, tools, only=None, parallel=True, thinking=False, text=False):
        """Lark text for a reply that is a call of one of `tools` (only `only`, if given), several
        calls with `parallel`, and also any text not starting with `{` with `text`. The generic
        templates have no reasoning block, so `thinking` changes nothing."""
        rules = []
        names = []
        for index, tool in enumerate(tools):
            if only is not None and tool_name(tool) != only:
                continue
            rules.append(f"args{index}: {json_rule(parameters_schema(tool))}")
            head = '{"name": ' + tool_json(tool_name(tool)) + ', "arguments": '
            rules.append(f"call{index}: {_literal(head)} args{index} {_literal('}')}")
            names.append(f"call{index}")
        branches = [_literal('{"tool_call": ') + " call " + _literal("}")]
        if parallel:
            branches.append(_literal('{"tool_calls": [') + " call (" + _literal(", ") + " call)+ " + _literal("]}"))
        if text:
            branches += ["TEXT", "EMPTY"]
            rules += ["TEXT: /[^{][\\s\\S]*/", 'EMPTY: ""']
        return "\n".join(["start: " + " | ".join(branches), "call: " + " | ".join(names), *rules])

    def parse(self, text, tools=()):
        """(content, calls): each JSON object starting with the trigger that is a call in the generic
        form gives its calls and leaves the content; other text stays content."""
        calls = []
        kept = []
        position = 0
        start = text.find(self.trigger)
        while start >= 0:
            found, end = self._read(text, start)
            if found:
                kept.append(text[position:start])
                calls.extend(found)
                position = end
            start = text.find(self.trigger, max(end, start + 1))
        kept.append(text[position:])
        return _content("".join(kept) if calls else text), calls

    def _read(self, text, start):
        """(calls, end) of the generic call object at `start`, or ([], start) when there is none."""
        try:
            value, end = self._decoder.raw_decode(text, start)
        except ValueError:
            return [], start
        if not isinstance(value, dict) or len(value) != 1:
            return [], start
        if "tool_call" in value:
            entries = [value["tool_call"]]
        elif isinstance(value.get("tool_calls"), list) and value["tool_calls"]:
            entries = value["tool_calls"]
        else:
            return [], start
        calls = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                return [], start
            arguments = _arguments(entry.get("arguments", {}))
            if arguments is None:
                return [], start
            calls.append(ToolCall(entry["name"], arguments))
        return calls, end

    text = staticmethod(generic_tool_call_text)


class HarmonyFormat(ToolFormat):
    """gpt-oss's harmony: a call is a commentary message to `functions.NAME` whose body is the
    arguments' JSON, `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}`
    as the template writes it; the model may put the recipient after the channel and mark the body
    `<|constrain|>json`, and ends the message with `<|call|>` (a stop marker) or `<|end|>`. One call
    per reply: the reply stops at it."""

    name = "harmony"
    parallel = False
    trigger = "<|start|>assistant to=functions."
    _call = re.compile(r"(?:<\|start\|>assistant)?(?:<\|channel\|>commentary)?\s*to=functions\.([^\s<]+)\s*"
                       r"(?:<\|channel\|>commentary)?\s*(?:<\|constrain\|>)?\s*(?:json)?\s*<\|message\|>(.*?)"
                       r"(?:<\|end\|>|<\|call\|>|\Z)", re.DOTALL)

    def grammar(self, tools, only=None, parallel=True, thinking=False):
        """The required call as the whole reply: no analysis first (gpt-oss's reasoning is a channel
        of its own, which a required call skips), so `thinking` changes nothing."""
        return super().grammar(tools, only=only, parallel=False)

    def _call_rule(self, index, tool, rules):
        # the reply continues the generation prompt `<|start|>assistant`: the call's header from there
        rules.append(f"args{index}: {json_rule(parameters_schema(tool))}")
        head = harmony_call_head(tool_name(tool))[len(HARMONY_GENERATION_PROMPT):]
        return f"{_literal(head)} args{index}"

    @staticmethod
    def _read(match, tools=()):
        try:
            arguments = _arguments(json.loads(match.group(2)))
        except ValueError:
            return None
        return None if arguments is None else ToolCall(match.group(1), arguments)

    text = staticmethod(harmony_tool_call_text)


FORMATS = {"qwen": QwenFormat(), "llama3": Llama3Format(), "qwen3.5": Qwen35Format(), "harmony": HarmonyFormat(),
           "generic": GenericFormat()}


class ToolStream:
    """Streamed text of a reply that may hold tool calls: `push(piece)` returns the content that
    can go out now; from the format's trigger on, everything waits for the end. Leading and
    trailing whitespace wait too, so what is sent is always a prefix of the final content
    (`finish(content)` returns the rest of it). A format with a `leading` text (Qwen's untagged
    call) holds back a reply that starts with it.
    """

    def __init__(self, tool_format):
        self.trigger = tool_format.trigger
        self.leading = getattr(tool_format, "leading", None)
        self.text = ""
        self.sent = 0           # characters of self.text sent, after the leading whitespace
        self.started = None     # where the sent content starts (the first non-space character)
        self.held = False       # a trigger was seen: nothing more is sent

    def push(self, piece):
        self.text += piece
        if self.held:
            return ""
        if self.started is None and self.leading and self.text.lstrip().startswith(self.leading):
            self.held = True
            return ""
        found = self.text.find(self.trigger)
        end = len(self.text) if found < 0 else found
        if found >= 0:
            self.held = True
        else:
            # a tail that could still grow into the trigger waits
            for size in range(min(len(self.trigger) - 1, len(self.text)), 0, -1):
                if self.trigger.startswith(self.text[-size:]):
                    end = len(self.text) - size
                    break
        if self.started is None:
            stripped = len(self.text[:end]) - len(self.text[:end].lstrip())
            if stripped == end:
                return ""
            self.started = stripped
            self.sent = stripped
        end = self.started + len(self.text[self.started:end].rstrip())
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, content):
        """The rest of the final `content` (None or the parsed content) after what was sent."""
        already = 0 if self.started is None else self.sent - self.started
        return (content or "")[already:]
