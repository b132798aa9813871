"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

A Responses request is translated into a chat request (`input` items become messages,
`instructions` the system message, function tools and `text.format` their chat spellings) and
validated by schema.parse_chat_request, so it runs as every other completion does: the same
CompletionRequest, the same Reply (queue, limits, metrics, log line). ResponseReply only writes the
result in the Responses shape: one `response` object, or typed server-sent events (`event: NAME`
lines, each with a `sequence_number`, no `[DONE]`).

Replies with `store` (the default) are kept in a ResponseStore, bounded by a count and a byte budget
(the oldest dropped first), so `previous_response_id` can continue a conversation: the stored
input and output come first, and the prompt then starts with the tokens of the previous turn, which
the KV cache still holds.
"""

import collections
import json
import uuid
from dataclasses import dataclass

from twisted.web.server import NOT_DONE_YET

from krafla_twisted.chat.templates import tool_json
from krafla_twisted.api.errors import APIError, InvalidRequest, NotFound, Unsupported
from krafla_twisted.api.resources import (APIResource, Endpoint, Reply, call_ids, json_response, require_chat,
                                          token_logprobs)
from krafla_twisted.api.schema import check_text, json_type, parse_chat_request, parse_json_body
from krafla_twisted.api.sse import EventStream

MAX_STORED_RESPONSES = 512          # responses kept for previous_response_id and GET
MAX_STORED_BYTES = 32 * 2**20       # their JSON (response and conversation) at most, in bytes
MAX_METADATA_KEYS = 16              # OpenAI's limits on `metadata`
MAX_METADATA_VALUE = 512

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
SAMPLING_FIELDS = ("model", "temperature", "top_p", "seed", "top_k", "stream", "parallel_tool_calls")

# A chat parameter named in an error, and what the Responses request calls it.
PARAM_NAMES = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
)


def responses_param(param):
    """The Responses request's name of a chat request's parameter (`tools[0].function.name` is `tools[0].name`)."""
    if not param:
        return param
    for chat, responses in PARAM_NAMES:
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return responses + param[len(chat):]
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    return param


def rename_param(error):
    """`error` with its parameter named as a Responses request names it (in `param` and the message)."""
    renamed = responses_param(error.param)
    if renamed != error.param:
        error.message = error.message.replace(f"'{error.param}", f"'{renamed}")
        error.param = renamed
    return error


@dataclass(frozen=True)
class Stored:
    """One kept response: the object GET returns, and its conversation (chat messages, the
    instructions left out, as OpenAI leaves them out of a continuation) with its output at the end."""

    response: dict
    conversation: tuple
    input_items: tuple = ()


class ResponseStore:
    """The last responses, oldest dropped first once there are more than `max_count` or their JSON
    passes `max_bytes`; one larger than the whole budget is not kept. I/O thread only."""

    def __init__(self, max_count=MAX_STORED_RESPONSES, max_bytes=MAX_STORED_BYTES):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items = collections.OrderedDict()   # id -> (Stored, size in bytes)

    def __len__(self):
        return len(self._items)

    def __contains__(self, response_id):
        return response_id in self._items

    def put(self, response_id, response, conversation, input_items=()):
        """Keep a response; False when it alone is larger than the budget (it is not kept)."""
        self.delete(response_id)
        # (an input item may keep a key or value with a lone surrogate, which is stored as it came)
        size = len(json.dumps([response, list(conversation), list(input_items)], ensure_ascii=False)
                   .encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            return False
        self._items[response_id] = (Stored(response, tuple(conversation), tuple(input_items)), size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped
        return True

    def get(self, response_id):
        """The Stored response, or None."""
        item = self._items.get(response_id)
        return item[0] if item is not None else None

    def delete(self, response_id):
        """Forget a response; False when it was not kept."""
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= item[1]
        return True


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the CompletionRequest it runs as, the conversation it continues
    or starts (chat messages, without the instructions), and the request fields the reply echoes."""

    completion: object
    conversation: tuple
    echo: dict
    store: bool
    input_items: tuple = ()     # this request's `input` as the items GET .../input_items lists


def _invalid(message, param):
    return InvalidRequest(message, param=param)


def _text_parts(content, where):
    """A message's content (a string, or text parts) as one string; images, files and audio are refused."""
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise _invalid(f"'{where}' must be a string or an array of content parts, not {json_type(content)}", where)
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        if not isinstance(part, dict):
            raise _invalid(f"'{at}' must be an object, not {json_type(part)}", at)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        elif isinstance(kind, str):
            raise Unsupported(f"This server reads only text; '{at}.type' cannot be {kind!r}", param=f"{at}.type")
        else:
            raise _invalid(f"'{at}.type' must be \"input_text\" or \"output_text\"", f"{at}.type")
        if not isinstance(text, str):
            raise _invalid(f"'{at}.text' must be a string, not {json_type(text)}", f"{at}.text")
        texts.append(check_text(text, f"{at}.text"))
    return "".join(texts)


def _string_field(item, name, where):
    value = item.get(name)
    if not isinstance(value, str):
        raise _invalid(f"'{where}.{name}' must be a string, not {json_type(value)}", f"{where}.{name}")
    return check_text(value, f"{where}.{name}")


def input_messages(value):
    """`input` (a string, or message, function_call and function_call_output items) as chat messages.
    Calls that follow an assistant message (or each other) join it, as one assistant turn."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": check_text(value, "input")}]
    if not isinstance(value, list):
        raise _invalid(f"'input' must be a string or an array of items, not {json_type(value)}", "input")
    out = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _invalid(f"'{where}' must be an object, not {json_type(item)}", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _invalid(f"'{where}.role' must be one of {', '.join(ROLES)}; got {json.dumps(role)}",
                               f"{where}.role")
            out.append({"role": role, "content": _text_parts(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = _string_field(item, "arguments", where)
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise _invalid(f"'{where}.arguments' is not JSON: {e}", f"{where}.arguments") from None
            if not isinstance(parsed, dict):
                raise _invalid(f"'{where}.arguments' must be a JSON object", f"{where}.arguments")
            call = {"id": _string_field(item, "call_id", where), "type": "function",
                    "function": {"name": _string_field(item, "name", where), "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = dict(out[-1], tool_calls=[*out[-1].get("tool_calls", ()), call])
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = _text_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string_field(item, "call_id", where), "content": content})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thinking: not part of the next prompt
        elif isinstance(kind, str):
            raise Unsupported(f"'{where}.type' {kind!r} is not supported; send message, function_call and "
                              "function_call_output items", param=f"{where}.type")
        else:
            raise _invalid(f"'{where}.type' must be a string, not {json_type(kind)}", f"{where}.type")
    return out


def input_items(value):
    """A valid `input` (input_messages has read it) as OpenAI lists it back: every item with an id
    and a status, a message's content as parts, a string input as one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}[kind]
        listed = dict(item, type=kind, id=item.get("id") if isinstance(item.get("id"), str) else _new_id(prefix))
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            listed["content"] = [{"type": part, "text": item["content"]}]
        if kind != "reasoning":
            listed.setdefault("status", "completed")
        items.append(listed)
    return items


def _tools(value):
    """(chat tools, echoed tools) of `tools`: function tools only; built-in tools are refused."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise _invalid(f"'tools' must be an array, not {json_type(value)}", "tools")
    chat, echo = [], []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _invalid(f"'{where}' must be an object, not {json_type(tool)}", where)
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str):
                raise Unsupported(f"This server runs only function tools; '{where}.type' cannot be {kind!r}",
                                  param=f"{where}.type")
            raise _invalid(f"'{where}.type' must be \"function\"", f"{where}.type")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _invalid(f"'{where}.strict' must be a boolean, not {json_type(strict)}", f"{where}.strict")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat.append({"type": "function", "function": function})
        echo.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                     "parameters": tool.get("parameters"), "strict": True if strict is None else strict})
    return chat, echo


def _tool_choice(value):
    """The chat spelling of `tool_choice`: a mode, or {"type": "function", "name"} as a chat function choice."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise _invalid("'tool_choice.name' must be the name of a function in 'tools'", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        raise Unsupported(f"'tool_choice' of type {value['type']!r} is not supported: send \"auto\", \"none\", "
                          "\"required\" or {\"type\": \"function\", \"name\": ...}", param="tool_choice")
    raise _invalid("'tool_choice' must be a string or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def _text_format(value):
    """(chat response_format or None, echoed `text`) of `text`."""
    if value is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise _invalid(f"'text' must be an object, not {json_type(value)}", "text")
    fmt = value.get("format")
    echo = {key: item for key, item in value.items() if key == "verbosity"}
    if fmt is None:
        return None, dict(echo, format={"type": "text"})
    if not isinstance(fmt, dict):
        raise _invalid(f"'text.format' must be an object, not {json_type(fmt)}", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}, dict(echo, format={"type": kind})
    if kind == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict") if fmt.get(key) is not None}
        echoed = {"type": "json_schema", "name": fmt.get("name"), "schema": fmt.get("schema"),
                  "strict": fmt.get("strict"), "description": fmt.get("description")}
        return {"type": "json_schema", "json_schema": spec}, dict(echo, format=echoed)
    raise _invalid(f"'text.format.type' must be \"text\", \"json_object\" or \"json_schema\", not {json.dumps(kind)}",
                   "text.format.type")


def _metadata(value):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid(f"'metadata' must be an object of strings, not {json_type(value)}", "metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise _invalid(f"'metadata' holds at most {MAX_METADATA_KEYS} keys; got {len(value)}", "metadata")
    for key, item in value.items():
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE or len(key) > 64:
            raise _invalid(f"'metadata.{key}' must be a string of at most {MAX_METADATA_VALUE} characters "
                           "(its key at most 64)", "metadata")
    return dict(value)


def _refuse_unsupported(body):
    if body.get("background") not in (None, False):
        raise Unsupported("This server answers while the request is open; 'background' must be false",
                          param="background")
    for name, why in (("conversation", "keeps no conversations; continue one with 'previous_response_id'"),
                      ("prompt", "has no stored prompt templates")):
        if body.get(name) is not None:
            raise Unsupported(f"This server {why} ('{name}')", param=name)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise _invalid(f"'truncation' must be \"auto\" or \"disabled\"; got {json.dumps(truncation)}", "truncation")


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _include(value):
    """Whether `include` asks for the output text's log probabilities. Its other values name what
    this server has none of (encrypted reasoning, built-in tools' results) and are accepted as asking
    for nothing, as the Codex CLI's `reasoning.encrypted_content` must be."""
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _invalid(f"'include' must be an array of strings, not {json_type(value)}", "include")
    return LOGPROBS_INCLUDE in value


def parse_responses_request(body, n_vocab, store):
    """A validated Responses request (InvalidRequest, Unsupported or NotFound on the first bad field),
    continuing the stored conversation of `previous_response_id`. This must be called in the I/O
    thread (it reads the store)."""
    _refuse_unsupported(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid(f"'instructions' must be a string, not {json_type(instructions)}", "instructions")
    keep = body.get("store")
    if keep is not None and not isinstance(keep, bool):
        raise _invalid(f"'store' must be a boolean, not {json_type(keep)}", "store")
    max_output_tokens = body.get("max_output_tokens")
    previous_id = body.get("previous_response_id")
    history = []
    if previous_id is not None:
        if not isinstance(previous_id, str):
            raise _invalid(f"'previous_response_id' must be a string, not {json_type(previous_id)}",
                           "previous_response_id")
        stored = store.get(previous_id)
        if stored is None:
            raise NotFound(f"Previous response with id '{previous_id}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(stored.conversation)
    conversation = history + input_messages(body.get("input"))
    chat_tools, echo_tools = _tools(body.get("tools"))
    response_format, echo_text = _text_format(body.get("text"))
    metadata = _metadata(body.get("metadata"))

    chat = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    system = [{"role": "system", "content": check_text(instructions, "instructions")}] if instructions else []
    chat["messages"] = system + conversation
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    if chat_tools is not None:
        chat["tools"] = chat_tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    if response_format is not None:
        chat["response_format"] = response_format
    top_logprobs = body.get("top_logprobs")
    if _include(body.get("include")) or top_logprobs is not None:  # the chat's logprobs, checked there
        chat["logprobs"] = True
        if top_logprobs is not None:
            chat["top_logprobs"] = top_logprobs
    try:
        completion = parse_chat_request(chat, n_vocab)
    except APIError as error:
        raise rename_param(error) from None
    echo = {
        "instructions": instructions,
        "tools": echo_tools,
        "tool_choice": body.get("tool_choice") if body.get("tool_choice") is not None else "auto",
        "text": echo_text,
        "temperature": chat.get("temperature"),
        "top_p": chat.get("top_p"),
        "max_output_tokens": completion.max_tokens,
        "previous_response_id": previous_id,
        "parallel_tool_calls": completion.parallel_tool_calls,
        "store": keep is not False,
        "metadata": metadata or {},
        "truncation": body.get("truncation") or "disabled",
        "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None,
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
        "background": False,
        "service_tier": "default",
        "top_logprobs": completion.logprobs,
    }
    for name, value in echo.items():   # echoed into the response: they must be text (no lone surrogate)
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _invalid(f"'{name}' holds a lone UTF-16 surrogate, which is not a character", name) from None
    return ResponsesRequest(completion, tuple(conversation), echo, keep is not False,
                            tuple(input_items(body.get("input"))))


def _new_id(prefix):
    return prefix + uuid.uuid4().hex


class _TypedEvents:
    """The Responses event stream over an EventStream: each payload goes out as `event: TYPE` with the
    next `sequence_number`, and there is no `[DONE]`."""

    def __init__(self, reply, request):
        self.reply = reply
        self.events = EventStream(request, on_stop=reply._client_gone, done=False)
        self.sequence = 0

    @property
    def started(self):
        return self.events.started

    def start(self):
        self.events.start()

    def send(self, payload):
        payload = dict(payload, sequence_number=self.sequence)
        self.sequence += 1
        self.events.send(payload, name=payload["type"])

    def end(self):
        self.events.end()


class ResponseReply(Reply):
    """One Responses request in flight: Reply's job, queue and streaming, with the result written as a
    `response` object (or its events), and kept in the store unless `store` is false."""

    def __init__(self, api, request, parsed, store):
        super().__init__(api, request, parsed.completion)
        self.parsed = parsed
        self.store = store
        self.id = _new_id("resp_")
        self.message_id = _new_id("msg_")
        self.created = int(api.clock.seconds())
        self.message_open = False
        self.streamed_text = []
        self.reasoning_id = _new_id("rs_")
        self.reasoning_open = False     # streamed: the reasoning item is added and not yet done
        self.streamed_reasoning = []
        self.message_index = 0          # the message's output_index: 1 after a reasoning item
        self.streamed_logprobs = []     # streamed: the logprobs entries sent so far
        if self.stream is not None:
            self.stream = _TypedEvents(self, request)

    def error_body(self, error):
        return rename_param(error).body()

    def _stream_error(self, error):
        """A started stream ends with `response.failed`, the error in the response object."""
        self.stream.send({"type": "response.failed", "response": self.failed_object(rename_param(error))})
        self.stream.end()

    # -- the response object

    def response_object(self, status, output, usage=None, incomplete=None, error=None):
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.api.backend.model_id,
            "output": output,
            "usage": usage,
            **self.parsed.echo,
        }

    def failed_object(self, error):
        code = error.code or ("server_error" if error.status >= 500 else "invalid_prompt")
        return self.response_object("failed", [], error={"code": code, "message": error.message})

    def _reasoning_item(self, text):
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message_item(self, text, status, logprobs=()):
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                            "logprobs": list(logprobs)}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _call_items(self, calls):
        return [{"type": "function_call", "id": _new_id("fc_"), "call_id": call_id, "name": call.name,
                 "arguments": tool_json(call.arguments), "status": "completed"}
                for call_id, call in zip(call_ids(self.completion, calls, "call_"), calls)]

    def _usage(self, result):
        return {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }

    # -- streaming: Reply._piece calls _ensure_stream_started, then sends _chunk(text)

    def _open_stream(self):
        if not self.stream.started:
            snapshot = self.response_object("in_progress", [])
            self.stream.send({"type": "response.created", "response": snapshot})
            self.stream.send({"type": "response.in_progress", "response": snapshot})

    def _reasoning_piece(self, text):
        """A thinking template's reasoning: a reasoning item (output 0) before the message."""
        self._open_stream()
        if not self.reasoning_open:
            self.reasoning_open = True
            self.message_index = 1
            self.stream.send({"type": "response.output_item.added", "output_index": 0,
                              "item": dict(self._reasoning_item(""), content=[])})
        self.streamed_reasoning.append(text)
        self.stream.send({"type": "response.reasoning_text.delta", "item_id": self.reasoning_id, "output_index": 0,
                          "content_index": 0, "delta": text})

    def _close_reasoning(self):
        if not self.reasoning_open:
            return
        self.reasoning_open = False
        text = "".join(self.streamed_reasoning)
        self.stream.send({"type": "response.reasoning_text.done", "item_id": self.reasoning_id, "output_index": 0,
                          "content_index": 0, "text": text})
        self.stream.send({"type": "response.output_item.done", "output_index": 0, "item": self._reasoning_item(text)})

    def _open_message(self):
        if self.message_open:
            return
        self._close_reasoning()
        self.message_open = True
        self.stream.send({"type": "response.output_item.added", "output_index": self.message_index,
                          "item": self._message_item(None, "in_progress")})
        self.stream.send({"type": "response.content_part.added", "item_id": self.message_id,
                          "output_index": self.message_index,
                          "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []}})

    def _ensure_stream_started(self):
        self._open_stream()
        self._open_message()

    def _logprobs(self, entries):
        """The output text's logprobs of these (bytes, logprob, top) entries: a list, one object per token."""
        return token_logprobs(entries)

    def _chunk(self, text, finish_reason, role=False, logprobs=None, tool_calls=None):
        self.streamed_text.append(text)
        entries = logprobs or []
        self.streamed_logprobs += entries
        return {"type": "response.output_text.delta", "item_id": self.message_id, "output_index": self.message_index,
                "content_index": 0, "delta": text, "logprobs": entries}

    def _stream_result(self, response, text, rest):
        self._open_stream()
        self._close_reasoning()
        index = self.message_index
        if len(response["output"]) > index and response["output"][index]["type"] == "message":
            self._open_message()
            if rest:
                self.stream.send(self._chunk(rest, None, logprobs=self._take_logprobs()))
            logprobs = response["output"][index]["content"][0]["logprobs"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            self.stream.send({"type": "response.output_text.done", "item_id": self.message_id, "output_index": index,
                              "content_index": 0, "text": text, "logprobs": logprobs})
            self.stream.send({"type": "response.content_part.done", "item_id": self.message_id, "output_index": index,
                              "content_index": 0, "part": part})
            self.stream.send({"type": "response.output_item.done", "output_index": index,
                              "item": response["output"][index]})
        for index, item in enumerate(response["output"]):
            if item["type"] != "function_call":
                continue
            self.stream.send({"type": "response.output_item.added", "output_index": index,
                              "item": dict(item, arguments="", status="in_progress")})
            self.stream.send({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                              "output_index": index, "delta": item["arguments"]})
            self.stream.send({"type": "response.function_call_arguments.done", "item_id": item["id"],
                              "output_index": index, "name": item["name"], "arguments": item["arguments"]})
            self.stream.send({"type": "response.output_item.done", "output_index": index, "item": item})
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self.stream.send({"type": kind, "response": response})
        self.stream.end()

    # -- the result

    def _conclude(self, result, content, calls, reasoning=None):
        incomplete = result.finish_reason == "length" and not calls
        item_status = "incomplete" if incomplete else "completed"
        output = [self._reasoning_item(reasoning)] if reasoning else []
        self.message_index = len(output)
        text = content or ""
        logprobs = ()
        if self.completion.logprobs is not None:  # every token's, as the chat's
            if self.stream is None:
                logprobs = self._logprobs(result.logprobs)
            else:  # those sent, and those the last delta (_stream_result) will send
                logprobs = self.streamed_logprobs + self._logprobs(self.pending_logprobs)
        if text or not calls:
            output.append(self._message_item(text, item_status, logprobs))
        call_items = self._call_items(calls)
        output += call_items
        response = self.response_object("incomplete" if incomplete else "completed", output, self._usage(result),
                                        {"reason": "max_output_tokens"} if incomplete else None)
        response["completed_at"] = None if incomplete else int(self.api.clock.seconds())
        if self.parsed.store:
            said = {"role": "assistant", "content": text}
            if call_items:
                said["tool_calls"] = [{"id": item["call_id"], "type": "function",
                                       "function": {"name": item["name"], "arguments": item["arguments"]}}
                                      for item in call_items]
            self.store.put(self.id, response, (*self.parsed.conversation, said), self.parsed.input_items)
        if self.stream is not None:
            rest = text[len("".join(self.streamed_text)):] if self.tool_stream is None else \
                self.tool_stream.finish(content)
            self._stream_result(response, text, rest)
            return
        self._write_whole(json_response(self.request, response))


class Responses(APIResource):
    """POST /v1/responses; /v1/responses/{id} is a StoredResponse."""

    methods = ("POST",)

    def __init__(self, api, store):
        super().__init__(api)
        self.store = store

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        backend = self.api.backend
        require_chat(backend, "/v1/completions")
        parsed = parse_responses_request(body, backend.n_vocab, self.store)
        self.api.admit()
        ResponseReply(self.api, request, parsed, self.store).start()
        return NOT_DONE_YET

    def getChild(self, path, request):
        if path == b"":
            return self
        response_id = path.decode("utf-8", "replace")
        if request.postpath[:1] == [b"input_items"]:
            request.prepath.append(request.postpath.pop(0))
            return InputItems(self.api, self.store, response_id)
        return StoredResponse(self.api, self.store, response_id)


class StoredResponse(Endpoint):
    """GET or DELETE a stored response."""

    methods = ("GET", "DELETE")

    def __init__(self, api, store, response_id):
        super().__init__(api)
        self.store = store
        self.response_id = response_id

    def _missing(self):
        return NotFound(f"Response with id '{self.response_id}' not found.", param="response_id")

    def render_GET(self, request):
        stored = self.store.get(self.response_id)
        if stored is None:
            raise self._missing()
        return json_response(request, stored.response)

    def render_DELETE(self, request):
        if not self.store.delete(self.response_id):
            raise self._missing()
        return json_response(request, {"id": self.response_id, "object": "response.deleted", "deleted": True})


class InputItems(Endpoint):
    """GET /v1/responses/{id}/input_items: a stored response's input items, as OpenAI pages them
    (`order` desc by default, `limit` 1-100 (20), `after` an item id)."""

    methods = ("GET",)

    def __init__(self, api, store, response_id):
        super().__init__(api)
        self.store = store
        self.response_id = response_id

    @staticmethod
    def _query(request, name):
        values = request.args.get(name.encode("ascii"))
        return values[-1].decode("utf-8", "replace") if values else None

    def render_GET(self, request):
        order = self._query(request, "order") or "desc"
        if order not in ("asc", "desc"):
            raise _invalid(f"'order' must be \"asc\" or \"desc\"; got {json.dumps(order)}", "order")
        limit = self._query(request, "limit") or "20"
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise _invalid(f"'limit' must be an integer from 1 to 100; got {json.dumps(limit)}", "limit")
        stored = self.store.get(self.response_id)
        if stored is None:
            raise NotFound(f"Response with id '{self.response_id}' not found.", param="response_id")
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        after = self._query(request, "after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise _invalid(f"'after': no input item {json.dumps(after)} in response '{self.response_id}'", "after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        return json_response(request, {"object": "list", "data": page,
                                       "first_id": page[0]["id"] if page else None,
                                       "last_id": page[-1]["id"] if page else None,
                                       "has_more": len(items) > len(page)})
