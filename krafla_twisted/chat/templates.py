"""The chat templates, rendered turn by turn into token segments.

A template turns a conversation into a list of segments: the BOS or EOS token, a special token
(`<|im_start|>`, inserted by id), plain text (encoded with special=False, so user text that looks
like a control token stays text), or an assistant message's content. An assistant's content is
a segment of its own, so a generation prompt ends exactly where the reply begins: the tokens of
turn N+1's prompt start with turn N's prompt, the reply's tokens and the stop token (for the
templates whose official form keeps earlier turns verbatim; Qwen3.5 drops the reasoning of
earlier turns, as its official template does). SentencePiece vocabularies with a space prefix
are the exception: see Template.render.

    template = get_template("chatml")
    ids = template.render([{"role": "user", "content": "Hi"}], tokenizer)
    text = template.render_text([{"role": "user", "content": "Hi"}])

The text of a rendering equals what the model's official Jinja template gives (tested against
jinja2 for llama3, qwen, smollm, gemma, qwen3.5, qwen3.5-nothink, qwen3, qwen3-nothink, mistral, phi3,
smollm3, smollm3-nothink and gpt-oss), with
`add_generation_prompt=True` when the conversation ends with a user or system message, and with
Hugging Face's `continue_final_message` when it ends with an assistant message, which is then
continued rather than closed.
"""

import json
import time
from dataclasses import dataclass


class ChatError(ValueError):
    """A conversation this template cannot render (the message says which message and why)."""


ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict   # the call's arguments, parsed from OpenAI's JSON string


@dataclass(frozen=True)
class Message:
    role: str       # "system", "user", "assistant" or "tool" ("developer" arrives as "system")
    content: str
    tool_calls: tuple = ()      # an assistant's ToolCalls
    tool_call_id: str = None    # a tool message: the call it answers


def tool_json(value, indent=None):
    """JSON as Hugging Face's chat templates write it (their `tojson`: key order kept, no ASCII escapes)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def normalize_messages(messages):
    """OpenAI-style message dicts to Messages: developer becomes system, content parts are joined."""
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatError("messages must not be empty")
    out = []
    for index, message in enumerate(messages):
        if isinstance(message, Message):
            out.append(message)
            continue
        if not isinstance(message, dict):
            raise ChatError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = content_text(message.get("content"), f"messages[{index}].content")
        calls = tuple(_tool_call(call, f"messages[{index}].tool_calls[{n}]")
                      for n, call in enumerate(message.get("tool_calls") or ()))
        out.append(Message("system" if role == "developer" else role, content, calls, message.get("tool_call_id")))
    return out


def _tool_call(call, where):
    if isinstance(call, ToolCall):
        return call
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatError(f"{where} must be an object with function.name and function.arguments")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ChatError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ChatError(f"{where}.function.arguments must be a JSON object")
    return ToolCall(function["name"], arguments)


def content_text(content, where="content"):
    """A message's content as one string: a string, None (""), or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        pieces = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"{where}[{index}] must be a {{\"type\": \"text\", \"text\": ...}} part")
            pieces.append(part["text"])
        return "".join(pieces)
    raise ChatError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


# ---------------------------------------------------------------------------------------------
# The generic tool form, for templates without a native one (docs/api.md, "Tool calls")

GENERIC_TOOLS_HEADER = ("# Tools\n\nYou can call the following tools. Each line is one tool: its name, what it does "
                        "and the JSON schema of its arguments.\n")
GENERIC_TOOLS_FOOTER = (
    "\nTo call a tool, reply with nothing but one JSON object in this form:\n"
    '{"tool_call": {"name": "<the tool\'s name>", "arguments": {<its arguments>}}}\n'
    "To call several tools at once, when that is allowed:\n"
    '{"tool_calls": [{"name": "<a tool\'s name>", "arguments": {<its arguments>}}, ...]}\n'
    'Each result comes back in a message of the form {"tool_response": {"name": "<the tool\'s name>", '
    '"content": <the result>}}.\nWhen no tool is needed, answer in plain text.')


def generic_tools_text(tools):
    """The system prompt's part that lists `tools` (OpenAI's tool objects) in the generic form: one
    JSON line per tool with its name, description (when it has one) and parameters' schema."""
    lines = []
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        entry = {"name": function.get("name")}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(tool_json(entry))
    return GENERIC_TOOLS_HEADER + "\n" + "\n".join(lines) + "\n" + GENERIC_TOOLS_FOOTER


def generic_call_json(call):
    """One call as the generic form's inner object: {"name": N, "arguments": {...}}."""
    return f'{{"name": {tool_json(call.name)}, "arguments": {tool_json(call.arguments)}}}'


def generic_tool_call_text(call):
    """One call in the generic form (and as krafla's grammar makes the model write it)."""
    return f'{{"tool_call": {generic_call_json(call)}}}'


def generic_tool_calls_text(calls):
    """An assistant's calls in the generic form: one as `{"tool_call": ...}`, several as `{"tool_calls": [...]}`."""
    if len(calls) == 1:
        return generic_tool_call_text(calls[0])
    return '{"tool_calls": [' + ", ".join(generic_call_json(call) for call in calls) + "]}"


def generic_tool_result_text(name, content):
    """A tool's result in the generic form; a result that is a JSON object or array is written as
    that JSON, anything else as a JSON string. `name` is None when no call is known for it."""
    value = content
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    if isinstance(parsed, (dict, list)):
        value = parsed
    body = {"name": name, "content": value} if name is not None else {"content": value}
    return tool_json({"tool_response": body})


def generic_conversation(system_prompt, messages, tools):
    """(system prompt, messages) with tools, calls and results in the generic form, as plain text any
    template carries: the tool list after the system prompt (or as the system prompt), an assistant's
    calls as JSON in its content, and each run of tool results as one user message (the n-th result
    after an assistant message with calls names the n-th call)."""
    if tools:
        listing = generic_tools_text(tools)
        system_prompt = listing if not (system_prompt or "").strip() else system_prompt.rstrip() + "\n\n" + listing
    out = []
    names = []          # the names of the last assistant message's calls not answered yet
    after_tool = False
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            calls = generic_tool_calls_text(message.tool_calls)
            content = message.content.rstrip() + "\n" + calls if message.content.strip() else calls
            out.append(Message("assistant", content))
            names = [call.name for call in message.tool_calls]
            after_tool = False
        elif message.role == "tool":
            result = generic_tool_result_text(names.pop(0) if names else None, message.content)
            if after_tool:
                out[-1] = Message("user", out[-1].content + "\n" + result)
            else:
                out.append(Message("user", result))
            after_tool = True
        else:
            out.append(message)
            after_tool = False
    return system_prompt, out


# ---------------------------------------------------------------------------------------------
# Segments

BOS, EOS, SPECIAL, TEXT, CONTENT = "bos", "eos", "special", "text", "content"


class _Segments:
    """Collects segments; adjacent text merges (as text between special tokens is one fragment
    for the tokenizer), assistant content never merges with its neighbours."""

    def __init__(self):
        self.items = []

    def bos(self):
        self.items.append((BOS, ""))

    def eos(self):
        self.items.append((EOS, ""))

    def special(self, marker):
        self.items.append((SPECIAL, marker))

    def text(self, text):
        if not text:
            return
        if self.items and self.items[-1][0] == TEXT:
            self.items[-1] = (TEXT, self.items[-1][1] + text)
        else:
            self.items.append((TEXT, text))

    def content(self, text):
        self.items.append((CONTENT, text))


class Template:
    """One chat format. Subclasses write a conversation into segments in `_write`."""

    name = ""
    bos_text = ""            # the BOS literal the official template writes, "" if it writes none
    eos_text = ""
    default_system = None    # the official template's system prompt when a conversation has none
    stop_markers = ()        # end-of-turn and end-of-text markers, as special tokens or text
    system_turn = True       # a system message after the first renders as its own turn
    stops_at_eos = False     # the tokenizer's EOS token ends a reply too (formats that end turns with </s>)
    tool_format = None       # the name of the template's native tool-call format (krafla_twisted.generation.tools);
                             # None: tools, calls and results are written in the generic form (generic_conversation)

    @property
    def stop_strings(self):
        """Texts that end a reply when the model spells them out instead of emitting the token."""
        return tuple(self.stop_markers)

    def stop_token_ids(self, tokenizer):
        """Ids of this template's stop markers that are single tokens in `tokenizer` (and its EOS
        token, for templates that stop at it)."""
        ids = set()
        for marker in self.stop_markers:
            token = tokenizer.token_id(marker)
            if token is not None:
                ids.add(token)
        if self.stops_at_eos and tokenizer.eos_id is not None and tokenizer.eos_id >= 0:
            ids.add(tokenizer.eos_id)
        return frozenset(ids)

    def segments(self, messages, system=None, tools=None):
        """The conversation as (kind, text) segments; kind is bos, eos, special, text or content.
        `tools`: OpenAI's tool objects, rendered in the template's own format, or in the generic
        form (generic_conversation) for a template without one."""
        messages = normalize_messages(messages)
        uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
        system_prompt, rest = self._split_system(messages, system)
        for index, message in enumerate(rest):
            if message.role == "system" and not self.system_turn:
                raise ChatError(f"the {self.name} template takes a system message only at the start "
                                f"(messages[{index + (len(messages) - len(rest))}] is a system message)")
        continue_last = bool(rest) and rest[-1].role == "assistant" and not rest[-1].tool_calls
        if uses_tools and self.tool_format is None:
            # No native format: the generic one, as plain text this template carries (see generic_conversation).
            system_prompt, rest = generic_conversation(system_prompt, rest, list(tools or ()))
        out = _Segments()
        if self.tool_format is not None:
            self._write(out, system_prompt, rest, continue_last, tools=list(tools or ()))
        else:
            self._write(out, system_prompt, rest, continue_last)
        return out.items

    def render_text(self, messages, system=None, tools=None):
        """The prompt as text, as the official template writes it."""
        parts = []
        for kind, text in self.segments(messages, system, tools):
            parts.append(self.bos_text if kind == BOS else self.eos_text if kind == EOS else text)
        return "".join(parts)

    def render(self, messages, tokenizer, system=None, tools=None):
        """The prompt as token ids: special markers by id, all other text with special=False.

        A SentencePiece tokenizer that adds a space prefix to every text it encodes (Llama 2,
        TinyLlama) would put one before each assistant message too, which the model never
        produces after its prompt; for those, all text between two special tokens is encoded
        as one piece, as llama.cpp does."""
        segments = self.segments(messages, system, tools)
        if getattr(tokenizer, "add_space_prefix", False):
            segments = _merge_text(segments)
        ids = []
        for kind, text in segments:
            if kind == BOS:
                if tokenizer.bos_id is not None and tokenizer.bos_id >= 0:
                    ids.append(tokenizer.bos_id)
            elif kind == EOS:
                if tokenizer.eos_id is not None and tokenizer.eos_id >= 0:
                    ids.append(tokenizer.eos_id)
                else:
                    ids.extend(tokenizer.encode(self.eos_text, add_bos=False, special=False))
            elif kind == SPECIAL:
                token = tokenizer.token_id(text)
                if token is None:
                    ids.extend(tokenizer.encode(text, add_bos=False, special=False))
                else:
                    ids.append(token)
            elif text:
                ids.extend(tokenizer.encode(text, add_bos=False, special=False))
        # Templates that write no BOS still get the one the tokenizer adds, as llama.cpp does.
        if (not self.bos_text and tokenizer.add_bos and tokenizer.bos_id is not None and tokenizer.bos_id >= 0
                and (not ids or ids[0] != tokenizer.bos_id)):
            ids.insert(0, tokenizer.bos_id)
        return ids

    def _split_system(self, messages, system):
        if messages[0].role == "system":
            return messages[0].content, messages[1:]
        if system is not None:
            return system, messages
        return self.default_system, messages

    def _write(self, out, system_prompt, messages, continue_last):
        raise NotImplementedError

    def __repr__(self):
        return f"<chat template {self.name}>"


def _merge_text(segments):
    merged = []
    for kind, text in segments:
        if kind in (TEXT, CONTENT) and merged and merged[-1][0] == TEXT:
            merged[-1] = (TEXT, merged[-1][1] + text)
        else:
            merged.append((TEXT if kind == CONTENT else kind, text))
    return merged


class TurnTemplate(Template):
    """A format of role turns: `_open` starts one, `turn_end` and a newline close it, and the
    generation prompt is an open assistant turn. `_write` writes a plain conversation (a system
    prompt first, as a turn of its own); templates with more to write (tools, reasoning) build on
    `_turn`, `_reply`, `_open` and `_close`."""

    turn_end = None

    def _open(self, out, role):
        raise NotImplementedError

    def _close(self, out):
        out.special(self.turn_end)
        out.text("\n")

    def _turn(self, out, role, content):
        self._open(out, role)
        out.text(content)
        self._close(out)

    def _reply(self, out, content, keep_open=False):
        """An assistant turn; `keep_open` leaves it open for the reply to continue."""
        self._open(out, "assistant")
        out.content(content)
        if not keep_open:
            self._close(out)

    def _keeps_system(self, content):
        """Whether a system prompt or message with this content is written (None never is)."""
        return content is not None

    def _write(self, out, system_prompt, messages, continue_last):
        if self._keeps_system(system_prompt):
            self._turn(out, "system", system_prompt)
        for index, message in enumerate(messages):
            if message.role == "assistant":
                self._reply(out, message.content, keep_open=continue_last and index == len(messages) - 1)
            elif message.role != "system" or self._keeps_system(message.content):
                self._turn(out, message.role, message.content)
        if not continue_last:
            self._open(out, "assistant")


class ChatMLTemplate(TurnTemplate):
    """`<|im_start|>role\\ncontent<|im_end|>\\n` turns (chatml, qwen, smollm, and the turns of qwen3,
    qwen3.5 and smollm3)."""

    stop_markers = ("<|im_end|>",)
    turn_end = "<|im_end|>"

    def __init__(self, name, default_system=None, stop_markers=("<|im_end|>",)):
        self.name = name
        self.default_system = default_system
        self.stop_markers = stop_markers

    def _open(self, out, role):
        out.special("<|im_start|>")
        out.text(role + "\n")

    def _tool_response(self, out, messages, index, content, opens):
        """A tool's result in `<tool_response>` tags (Qwen2.5, Qwen3.5): consecutive results share
        one user turn, which `opens` starts; the last of them closes it."""
        if opens:
            out.special("<|im_start|>")
            out.text("user")
        out.text(f"\n<tool_response>\n{content}\n</tool_response>")
        if index == len(messages) - 1 or messages[index + 1].role != "tool":
            self._close(out)

    @staticmethod
    def _think(out, reasoning, after="\n\n"):
        """A think block holding `reasoning` (empty: the closed block of a no-thinking mode)."""
        out.special("<think>")
        out.text("\n" + reasoning + "\n")
        out.special("</think>")
        out.text(after)


def _split_reasoning(content):
    """(reasoning, answer) of an assistant message whose reasoning ends at `</think>`, as the Qwen3
    templates split it; ("", content) when it has none."""
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


def _last_query(messages, strip):
    """The index of the last user message that is not a tool response, or None (`strip`: the
    content is trimmed before the test, as Qwen3.5's template does)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        text = message.content.strip() if strip else message.content
        if message.role == "user" and not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return index
    return None


QWEN_TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                     "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
QWEN_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                     "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                     "\"arguments\": <args-json-object>}\n</tool_call>")


def qwen_tool_call_text(call):
    """One call as Qwen2.5 writes it (and as krafla's grammar makes the model write it)."""
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {tool_json(call.arguments)}}}\n</tool_call>'


class QwenTemplate(ChatMLTemplate):
    """Qwen2.5: chatml with tools in the system turn, calls in `<tool_call>` tags and tool results
    in `<tool_response>` tags inside one user turn, as its official template writes them."""

    tool_format = "qwen"

    def __init__(self):
        super().__init__("qwen", QWEN_SYSTEM, ("<|im_end|>", "<|endoftext|>"))

    def _write(self, out, system_prompt, messages, continue_last, tools=()):
        if tools:
            self._open(out, "system")
            out.text((system_prompt if system_prompt is not None else QWEN_SYSTEM) + QWEN_TOOLS_HEADER)
            for tool in tools:
                out.text("\n" + tool_json(tool))
            out.text(QWEN_TOOLS_FOOTER)
            self._close(out)
        elif system_prompt is not None:
            self._turn(out, "system", system_prompt)
        for index, message in enumerate(messages):
            if message.role == "tool":
                self._tool_response(out, messages, index, message.content,
                                    opens=index == 0 or messages[index - 1].role != "tool")
            elif message.role == "assistant":
                content = message.content
                if message.tool_calls:
                    calls = "\n".join(qwen_tool_call_text(call) for call in message.tool_calls)
                    content = content + "\n" + calls if content else calls
                self._reply(out, content, keep_open=continue_last and index == len(messages) - 1)
            else:
                self._turn(out, message.role, message.content)
        if not continue_last:
            self._open(out, "assistant")


LLAMA3_TOOLS_PROMPT = ("Given the following functions, please respond with a JSON for a function call with its proper "
                       "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                       "\"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n")


def llama3_tool_call_text(call):
    """One call as Llama 3.1 writes it."""
    return f'{{"name": "{call.name}", "parameters": {tool_json(call.arguments)}}}'


class Llama3Template(Template):
    """Llama 3.1's format: a system header with the knowledge cutoff and date, trimmed contents."""

    name = "llama3"
    bos_text = "<|begin_of_text|>"
    stop_markers = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    date_string = "26 Jul 2024"
    tool_format = "llama3"

    def _write(self, out, system_prompt, messages, continue_last, tools=()):
        out.bos()
        self._header(out, "system")
        if tools:
            out.text("Environment: ipython\n")
        out.text(f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n")
        out.text((system_prompt or "").strip())
        out.special("<|eot_id|>")
        if tools:
            # The official template puts the tools in the first message after the system prompt.
            if not messages:
                raise ChatError("the llama3 template puts the tools in the first user message, and there is none")
            self._header(out, "user")
            out.text(LLAMA3_TOOLS_PROMPT)
            for tool in tools:
                out.text(tool_json(tool, indent=4) + "\n\n")
            out.text(messages[0].content.strip())
            out.special("<|eot_id|>")
            messages = messages[1:]
            continue_last = continue_last and bool(messages)
        for index, message in enumerate(messages):
            if message.role == "tool":
                self._header(out, "ipython")
                # The official template writes a result through tojson (a string is iterable in Jinja).
                out.text(tool_json(message.content))
                out.special("<|eot_id|>")
                continue
            if message.tool_calls:
                if len(message.tool_calls) != 1:
                    raise ChatError("the llama3 template takes one tool call per assistant message, as its "
                                    f"official template does; an assistant message has {len(message.tool_calls)}")
                self._header(out, "assistant")
                out.content(llama3_tool_call_text(message.tool_calls[0]))
                out.special("<|eot_id|>")
                continue
            self._header(out, message.role)
            if message.role == "assistant":
                out.content(message.content.strip())
                if index == len(messages) - 1 and continue_last:
                    continue
            else:
                out.text(message.content.strip())
            out.special("<|eot_id|>")
        if not continue_last:
            self._header(out, "assistant")

    @staticmethod
    def _header(out, role):
        out.special("<|start_header_id|>")
        out.text(role)
        out.special("<|end_header_id|>")
        out.text("\n\n")


class GemmaTemplate(Template):
    """Gemma's turns (`model` for the assistant, trimmed contents); a system prompt goes before
    the first user message's content followed by a blank line, as Gemma 3's template does."""

    name = "gemma"
    bos_text = "<bos>"
    stop_markers = ("<end_of_turn>", "<eos>")
    system_turn = False

    def _write(self, out, system_prompt, messages, continue_last):
        out.bos()
        if not messages:
            messages = [Message("user", "")]
        prefix = "" if system_prompt is None else system_prompt + "\n\n"
        for index, message in enumerate(messages):
            out.special("<start_of_turn>")
            first = prefix if index == 0 else ""
            if message.role == "assistant":
                out.text("model\n" + first)
                out.content(message.content.strip())
                if index == len(messages) - 1 and continue_last:
                    continue
            else:
                out.text(f"{message.role}\n{first}{message.content.strip()}")
            out.special("<end_of_turn>")
            out.text("\n")
        if not continue_last:
            out.special("<start_of_turn>")
            out.text("model\n")


class EndsAtEosTemplate(Template):
    """A format whose replies end with `</s>` (llama2, zephyr, mistral): that text, or the
    tokenizer's EOS token, ends a reply."""

    eos_text = "</s>"
    stop_markers = ("</s>",)
    stops_at_eos = True


class Llama2Template(EndsAtEosTemplate):
    """Llama 2 chat: `<s>[INST] <<SYS>>\\nS\\n<</SYS>>\\n\\nU [/INST] A </s>`, with [INST] as text."""

    name = "llama2"
    bos_text = "<s>"
    system_turn = False

    def _write(self, out, system_prompt, messages, continue_last):
        if not messages:
            messages = [Message("user", "")]
        for index, message in enumerate(messages):
            content = message.content
            if index == 0 and system_prompt is not None:
                content = f"<<SYS>>\n{system_prompt}\n<</SYS>>\n\n{content}"
            if message.role == "assistant":
                out.content(" " + content.strip())
                if index == len(messages) - 1 and continue_last:
                    continue
                out.text(" ")
                out.eos()
            else:
                out.bos()
                out.text(f"[INST] {content.strip()} [/INST]")


class ZephyrTemplate(EndsAtEosTemplate):
    """Zephyr / TinyLlama chat: `<|user|>\\nU</s>\\n<|assistant|>\\n`, the role tags as text."""

    name = "zephyr"

    def _write(self, out, system_prompt, messages, continue_last):
        if system_prompt is not None:
            out.text(f"<|system|>\n{system_prompt}")
            out.eos()
            out.text("\n")
        for index, message in enumerate(messages):
            if message.role == "assistant":
                out.text("<|assistant|>\n")
                out.content(message.content)
                if index == len(messages) - 1 and continue_last:
                    continue
            else:
                out.text(f"<|{message.role}|>\n{message.content}")
            out.eos()
            out.text("\n")
        if not continue_last:
            out.text("<|assistant|>\n")


class Qwen35Template(ChatMLTemplate):
    """Qwen3.5: chatml turns with trimmed contents; assistant messages after the last user query
    carry a `<think>` block (their reasoning, split off at `</think>`), earlier ones only their
    answer. The generation prompt opens a think block, or with -nothink an empty, closed one."""

    stop_markers = ("<|im_end|>", "<|endoftext|>")
    system_turn = False
    tool_format = "qwen3.5"
    opens_think = True      # a thinking reply starts inside the <think> block (generation.reasoning)

    def __init__(self, name, thinking):
        self.name = name
        self.thinking = thinking

    def _write(self, out, system_prompt, messages, continue_last, tools=()):
        if tools:
            self._open(out, "system")
            out.text(QWEN35_TOOLS_HEADER)
            for tool in tools:
                out.text("\n" + tool_json(tool))
            out.text(QWEN35_TOOLS_FOOTER)
            if system_prompt is not None and system_prompt.strip():
                out.text("\n\n" + system_prompt.strip())
            self._close(out)
        elif system_prompt is not None:
            self._turn(out, "system", system_prompt.strip())
        last_query = _last_query(messages, strip=True)
        if last_query is None:
            raise ChatError(f"the {self.name} template needs a user message")
        for index, message in enumerate(messages):
            content = message.content.strip()
            if message.role == "user":
                self._turn(out, "user", content)
                continue
            if message.role == "tool":
                previous = messages[index - 1].role if index else ("system" if system_prompt is not None else None)
                self._tool_response(out, messages, index, content, opens=previous is not None and previous != "tool")
                continue
            reasoning, content = _split_reasoning(content)
            self._open(out, "assistant")
            if index > last_query:
                self._think(out, reasoning.strip())
            if message.tool_calls:
                calls = "\n".join(qwen35_tool_call_text(call) for call in message.tool_calls)
                content = content + "\n\n" + calls if content.strip() else content + calls
            out.content(content)
            if not (index == len(messages) - 1 and continue_last):
                self._close(out)
        if not continue_last:
            self._open(out, "assistant")
            if self.thinking:
                out.special("<think>")
                out.text("\n")
            else:
                self._think(out, "")


QWEN35_TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN35_TOOLS_FOOTER = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>")


def qwen35_parameter_text(value):
    """A parameter value as Qwen3.5's template writes it: objects and arrays as JSON, the rest
    through Jinja's `string` filter (Python's str: True, None, 1.5)."""
    if isinstance(value, (dict, list)):
        return tool_json(value)
    return str(value)


def qwen35_tool_call_text(call):
    """One call in Qwen3.5's XML form."""
    parameters = "".join(f"<parameter={name}>\n{qwen35_parameter_text(value)}\n</parameter>\n"
                         for name, value in call.arguments.items())
    return f"<tool_call>\n<function={call.name}>\n{parameters}</function>\n</tool_call>"


class Qwen3Template(ChatMLTemplate):
    """Qwen3: chatml turns kept as written; an assistant message after the last user query gets a
    `<think>` block when it is the last message or has reasoning (split off at `</think>`),
    earlier ones only their answer. The generation prompt is the bare assistant header, or with
    -nothink an empty, closed think block after it (enable_thinking=false)."""

    stop_markers = ("<|im_end|>", "<|endoftext|>")

    def __init__(self, name, thinking):
        self.name = name
        self.thinking = thinking

    def _write(self, out, system_prompt, messages, continue_last):
        if system_prompt is not None:
            self._turn(out, "system", system_prompt)
        last_query = _last_query(messages, strip=False)
        if last_query is None:
            last_query = len(messages) - 1
        for index, message in enumerate(messages):
            if message.role != "assistant":
                self._turn(out, message.role, message.content)
                continue
            reasoning, content = _split_reasoning(message.content)
            last = index == len(messages) - 1
            self._open(out, "assistant")
            if index > last_query and (last or reasoning):
                self._think(out, reasoning.strip("\n"))
                content = content.lstrip("\n")
            out.content(content)
            if not (last and continue_last):
                self._close(out)
        if not continue_last:
            self._open(out, "assistant")
            if not self.thinking:
                self._think(out, "")


class MistralTemplate(EndsAtEosTemplate):
    """Mistral's v3 (Tekken) format, as Mistral Nemo's template writes it: `<s>[INST]U[/INST]A</s>`;
    a system message goes before the last user message, and only when that message ends the
    conversation (a conversation ending with an assistant message drops it, as the official
    template does). Roles must alternate user/assistant after the system message."""

    name = "mistral"
    bos_text = "<s>"
    system_turn = False

    def _write(self, out, system_prompt, messages, continue_last):
        for index, message in enumerate(messages):
            if (message.role == "user") != (index % 2 == 0):
                raise ChatError("the mistral template needs roles alternating user/assistant/user/... after "
                                f"an optional system message (message {index} after it is {message.role})")
        out.bos()
        for index, message in enumerate(messages):
            last = index == len(messages) - 1
            if message.role == "user":
                out.special("[INST]")
                if last and system_prompt is not None:
                    out.text(system_prompt + "\n\n")
                out.text(message.content)
                out.special("[/INST]")
            else:
                out.content(message.content)
                if not (last and continue_last):
                    out.eos()


class Phi3Template(TurnTemplate):
    """Phi-3 / Phi-3.5: `<|role|>\\ncontent<|end|>\\n` turns with the tags as special tokens; an
    empty system message is left out."""

    name = "phi3"
    eos_text = "<|endoftext|>"
    stop_markers = ("<|end|>", "<|endoftext|>")
    turn_end = "<|end|>"

    def _open(self, out, role):
        out.special(f"<|{role}|>")
        out.text("\n")

    def _keeps_system(self, content):
        return bool(content)


SMOLLM3_THINK_SYSTEM = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves "
    "thoroughly exploring questions through a systematic thinking process before providing the final precise "
    "and accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, "
    "exploration, reassessment, reflection, backtracking, and iteration to develop well-considered thinking "
    "process. Please structure your response into two main sections: Thought and Solution using the specified "
    "format: <think> Thought section </think> Solution section. In the Thought section, detail your reasoning "
    "process in steps. Each step should include detailed considerations such as analysing questions, "
    "summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, "
    "refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, "
    "explorations, and reflections from the Thought section, systematically present the final solution that "
    "you deem correct. The Solution section should be logical, accurate, and concise and detail necessary "
    "steps needed to reach the conclusion.")
SMOLLM3_NOTHINK_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."


class SmolLM3Template(ChatMLTemplate):
    """SmolLM3: chatml turns after a system header (metadata, the reasoning mode and the custom
    instructions, or a default prompt for the mode). `/think` or `/no_think` in the system
    message picks the mode and is removed from it; -nothink starts in /no_think, where every
    assistant turn and the generation prompt carry an empty think block."""

    stop_markers = ("<|im_end|>", "<|end_of_text|>")
    system_turn = False

    def __init__(self, name, thinking):
        self.name = name
        self.thinking = thinking

    def _write(self, out, system_prompt, messages, continue_last):
        thinking, instructions = self.thinking, ""
        if system_prompt is not None:
            if "/no_think" in system_prompt:
                thinking = False
            elif "/think" in system_prompt:
                thinking = True
            instructions = system_prompt.replace("/no_think", "").replace("/think", "").rstrip()
        if not instructions:
            instructions = SMOLLM3_THINK_SYSTEM if thinking else SMOLLM3_NOTHINK_SYSTEM
        self._turn(out, "system", "## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
                   f"Reasoning Mode: {'/think' if thinking else '/no_think'}\n\n"
                   f"## Custom Instructions\n\n{instructions}\n\n")
        for index, message in enumerate(messages):
            if message.role == "user":
                self._turn(out, "user", message.content)
                continue
            self._assistant_header(out, thinking)
            out.content(message.content.lstrip("\n"))
            if not (index == len(messages) - 1 and continue_last):
                self._close(out)
        if not continue_last:
            self._assistant_header(out, thinking)

    def _assistant_header(self, out, thinking):
        self._open(out, "assistant")
        if not thinking:
            self._think(out, "", after="\n")


# ---------------------------------------------------------------------------------------------
# gpt-oss: OpenAI's harmony format

HARMONY_SYSTEM = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
                  "Current date: {date}\n\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, final. "
                  "Channel must be included for every message.\nCalls to these tools must go to the commentary "
                  "channel: 'functions'.")
# What the official template refuses inside an assistant message's content
HARMONY_CHANNEL_TAGS = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")


def harmony_type(schema):
    """A JSON schema as the TypeScript-like type gpt-oss's template writes (its
    render_typescript_type), whitespace and all."""
    kind = schema.get("type")
    nullable = " | null" if schema.get("nullable") else ""
    if kind == "array":
        items = schema.get("items")
        if not items:
            return "any[]" + nullable
        simple = {"string": "string[]", "number": "number[]", "integer": "number[]", "boolean": "boolean[]"}
        if isinstance(items.get("type"), str) and items["type"] in simple:
            return simple[items["type"]] + nullable
        inner = harmony_type(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + nullable
    if isinstance(kind, (list, tuple)) and kind:
        return " | ".join(kind)
    if schema.get("oneOf"):
        variants = schema["oneOf"]
        if len(variants) > 1 and any(v.get("type") == "object" for v in variants):
            return "any"
        parts = []
        for index, variant in enumerate(variants):
            part = harmony_type(variant)
            if variant.get("description"):
                part += "// " + variant["description"]
            if "default" in variant:
                part += " " * 20 + "// default: " + tool_json(variant["default"])
            if index < len(variants) - 1:
                part += " | \n"
            parts.append(part)
        return "".join(parts)
    if kind == "string":
        if schema.get("enum"):
            return '"' + '" | "'.join(schema["enum"]) + '"'
        return "string" + nullable
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        properties = schema.get("properties")
        if not properties:
            return "object"
        required = schema.get("required") or []
        fields = [name + ("" if name in required else "?") + ": \n" + " " * 16 + harmony_type(spec)
                  for name, spec in properties.items()]
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def harmony_tools_text(tools):
    """The tools as the `functions` namespace of gpt-oss's developer message. A tool or parameter
    without a description gets no comment line (the official template fails on them)."""
    lines = ["## functions\n\nnamespace functions {\n\n"]
    for tool in tools:
        function = tool["function"]
        if function.get("description"):
            lines.append("// " + function["description"] + "\n")
        lines.append("type " + function["name"] + " = (")
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties")
        if not properties:
            lines.append("\n}) => any;\n")
            continue
        required = parameters.get("required") or []
        fields = []
        for name, spec in properties.items():
            field = ("// " + spec["description"] + "\n") if spec.get("description") else ""
            field += name + ("" if name in required else "?") + ": " + harmony_type(spec)
            if "default" in spec:
                field += ("// default: " + str(spec["default"]) if spec.get("oneOf")
                          else ", // default: " + tool_json(spec["default"]))
            fields.append(field)
        lines.append("_: {\n" + ",\n".join(fields) + ",\n}) => any;\n")
    lines.append("\n} // namespace functions")
    return "".join(lines)


HARMONY_GENERATION_PROMPT = "<|start|>assistant"


def harmony_call_head(name):
    """The header of gpt-oss's commentary message calling `name`, up to its body."""
    return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>"


def harmony_tool_call_text(call):
    """One call as gpt-oss's template writes it: a commentary message to functions.NAME whose body
    is the arguments' JSON (in the prompt it ends with <|end|>; the model ends it with <|call|>)."""
    return harmony_call_head(call.name) + tool_json(call.arguments)


class HarmonyTemplate(Template):
    """gpt-oss's harmony format: `<|start|>ROLE<|message|>...<|end|>` messages. A system message
    names the model, the date and the reasoning effort; the conversation's own system (or
    developer) message and the tools go in a developer message; an assistant answers in the final
    channel, thinks in the analysis channel (dropped from earlier turns, as the official template
    drops it) and calls a tool in the commentary channel (`to=functions.NAME`, its arguments as
    JSON), a call's result coming back as `functions.NAME to=assistant`. A reply ends at
    `<|return|>` (its answer) or `<|call|>` (a call); `<|end|>` only ends one of its messages."""

    name = "gpt-oss"
    stop_markers = ("<|return|>", "<|call|>")
    system_turn = False
    tool_format = "harmony"
    thinking = True
    reasoning_format = "harmony"   # generation.reasoning: channels, not <think> blocks
    reply_control_tokens = True    # the reply is decoded with its control tokens, which mark the channels
    effort = "medium"

    @staticmethod
    def today():
        """The system message's date (the official template's strftime_now("%Y-%m-%d"))."""
        return time.strftime("%Y-%m-%d")

    def _message(self, out, header, content, end="<|end|>", as_content=False):
        out.special("<|start|>")
        parts = header.split("<|channel|>")
        out.text(parts[0])
        for part in parts[1:]:
            out.special("<|channel|>")
            out.text(part)
        out.special("<|message|>")
        if as_content:
            out.content(content)
        else:
            out.text(content)
        if end:
            out.special(end)

    def _write(self, out, system_prompt, messages, continue_last, tools=()):
        self._message(out, "system", HARMONY_SYSTEM.format(date=self.today(), effort=self.effort))
        if system_prompt or tools:
            developer = "# Instructions\n\n" + system_prompt if system_prompt else ""
            if tools:
                developer += "\n\n# Tools\n\n" + harmony_tools_text(tools)
            self._message(out, "developer", developer)
        last_call = None
        for index, message in enumerate(messages):
            where = f"messages[{index}]"
            if message.role == "user":
                self._message(out, "user", message.content)
            elif message.role == "tool":
                if last_call is None:
                    raise ChatError(f"{where} is a tool result, but no assistant message before it calls a tool")
                self._message(out, f"functions.{last_call} to=assistant<|channel|>commentary",
                              tool_json(message.content))
            elif message.role == "assistant":
                if any(tag in message.content for tag in HARMONY_CHANNEL_TAGS):
                    raise ChatError(f"{where}.content holds harmony channel tags; pass the reply's final text only")
                if message.tool_calls:
                    if message.content:
                        self._message(out, "assistant<|channel|>analysis", message.content)
                    for call in message.tool_calls:  # the official template writes the first one only
                        self._message(out, f"assistant to=functions.{call.name}<|channel|>commentary json",
                                      tool_json(call.arguments))
                        last_call = call.name
                elif continue_last and index == len(messages) - 1:
                    self._message(out, "assistant<|channel|>final", message.content, end=None, as_content=True)
                else:
                    self._message(out, "assistant<|channel|>final", message.content, as_content=True)
                    last_call = None
        if not continue_last:  # HARMONY_GENERATION_PROMPT
            out.special("<|start|>")
            out.text("assistant")


QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEMPLATES = {
    "llama3": Llama3Template(),
    "zephyr": ZephyrTemplate(),
    "llama2": Llama2Template(),
    "chatml": ChatMLTemplate("chatml"),
    "qwen": QwenTemplate(),
    "smollm": ChatMLTemplate("smollm", SMOLLM_SYSTEM, ("<|im_end|>", "<|endoftext|>")),
    "gemma": GemmaTemplate(),
    "qwen3.5": Qwen35Template("qwen3.5", thinking=True),
    "qwen3.5-nothink": Qwen35Template("qwen3.5-nothink", thinking=False),
    "qwen3": Qwen3Template("qwen3", thinking=True),
    "qwen3-nothink": Qwen3Template("qwen3-nothink", thinking=False),
    "mistral": MistralTemplate(),
    "phi3": Phi3Template(),
    "smollm3": SmolLM3Template("smollm3", thinking=True),
    "smollm3-nothink": SmolLM3Template("smollm3-nothink", thinking=False),
    "gpt-oss": HarmonyTemplate(),
}

TEMPLATE_NAMES = tuple(TEMPLATES)


def get_template(name):
    """The template called `name` (one of TEMPLATE_NAMES); ChatError for another name."""
    try:
        return TEMPLATES[name]
    except (KeyError, TypeError):
        raise ChatError(f"unknown chat template {name!r}; known: {', '.join(TEMPLATE_NAMES)}") from None
