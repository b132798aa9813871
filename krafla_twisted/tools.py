"""Tool calls: each chat template's own format for them, read back out of a reply, and the grammar
that makes a model write one when the request requires it.

    fmt = tools.FORMATS[template.tool_format]          # "qwen" (Qwen2.5) or "llama3" (Llama 3.1)
    grammar = fmt.grammar(request_tools, only="get_weather", parallel=False)   # Lark text for llguidance
    content, calls = fmt.parse(reply_text)              # calls: [chat.ToolCall], content: str or None

The renderings of tools, calls and results are in krafla_twisted.chat (each template writes its
own); what a model writes is parsed here with the same spellings. `ToolStream` splits a streamed
reply into content that can be sent at once and a held-back rest that may be a call.
"""

import json
import re

from krafla_twisted.chat import ToolCall, llama3_tool_call_text, qwen_tool_call_text
from krafla_twisted.grammar import json_rule


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


class QwenFormat:
    """Qwen2.5 (Hermes style): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, one
    per call, separated by newlines."""

    name = "qwen"
    trigger = "<tool_call>"
    parallel = True
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)

    def grammar(self, tools, only=None, parallel=True):
        rules = []
        names = []
        for index, tool in enumerate(tools):
            if only is not None and tool_name(tool) != only:
                continue
            head = '<tool_call>\n{"name": "' + tool_name(tool) + '", "arguments": '
            rules.append(f"call{index}: {_literal(head)} args{index} {_literal(chr(125) + chr(10) + '</tool_call>')}")
            rules.append(f"args{index}: {json_rule(parameters_schema(tool))}")
            names.append(f"call{index}")
        calls = " | ".join(names)
        start = f'start: call ("\\n" call)*' if parallel and self.parallel else "start: call"
        return "\n".join([start, f"call: {calls}", *rules])

    def parse(self, text):
        calls = []
        kept = []
        position = 0
        for match in self._call.finditer(text):
            call = self._read(match.group(1))
            if call is None:
                continue
            kept.append(text[position:match.start()])
            position = match.end()
            calls.append(call)
        kept.append(text[position:])
        return _content("".join(kept) if calls else text), calls

    @staticmethod
    def _read(body):
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = _arguments(value.get("arguments", {}))
        return None if arguments is None else ToolCall(value["name"], arguments)

    text = staticmethod(qwen_tool_call_text)


class Llama3Format:
    """Llama 3.1: the whole reply is `{"name": N, "parameters": {...}}` (one call per turn)."""

    name = "llama3"
    trigger = "{"
    parallel = False

    def grammar(self, tools, only=None, parallel=False):
        rules = []
        names = []
        for index, tool in enumerate(tools):
            if only is not None and tool_name(tool) != only:
                continue
            head = '{"name": "' + tool_name(tool) + '", "parameters": '
            rules.append(f"call{index}: {_literal(head)} args{index} {_literal(chr(125))}")
            rules.append(f"args{index}: {json_rule(parameters_schema(tool))}")
            names.append(f"call{index}")
        return "\n".join(["start: call", "call: " + " | ".join(names), *rules])

    def parse(self, text):
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


def _content(text):
    text = text.strip()
    return text or None


FORMATS = {"qwen": QwenFormat(), "llama3": Llama3Format()}


class ToolStream:
    """Streamed text of a reply that may hold tool calls: `push(piece)` returns the content that
    can go out now; from the format's trigger on, everything waits for the end. Leading and
    trailing whitespace wait too, so what is sent is always a prefix of the final content
    (`finish(content)` returns the rest of it)."""

    def __init__(self, tool_format):
        self.trigger = tool_format.trigger
        self.text = ""
        self.sent = 0           # characters of self.text sent, after the leading whitespace
        self.started = None     # where the sent content starts (the first non-space character)
        self.held = False       # a trigger was seen: nothing more is sent

    def push(self, piece):
        self.text += piece
        if self.held:
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
