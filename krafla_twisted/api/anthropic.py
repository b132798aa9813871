"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens (and without /v1).

A thin translation onto what the OpenAI endpoints use. The body is checked with Anthropic's field
names, rebuilt as OpenAI's chat body (a `system` message first, `tool_use` blocks as an assistant's
`tool_calls`, each `tool_result` block as a `tool` message, `stop_sequences` as `stop`, `tool_choice`
`any` as "required") and validated by schema.parse_chat_request into the same CompletionRequest; the
reply is a resources.Reply, so the generator, limits, API key, CORS, queue, metrics and log line are
the ones every endpoint has. What differs is only the shape of what is written:

    {"id": "msg_...", "type": "message", "role": "assistant", "model": M,
     "content": [{"type": "text", "text": T}, {"type": "tool_use", "id": "toolu_...", "name": N, "input": {...}}],
     "stop_reason": "end_turn" | "max_tokens" | "stop_sequence" | "tool_use", "stop_sequence": S or null,
     "usage": {"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}}

streamed as Anthropic's named events (message_start, ping, content_block_start/_delta/_stop,
message_delta, message_stop; no [DONE]), and errors as `{"type": "error", "error": {"type",
"message"}}` with the HTTP status the OpenAI endpoints give (an `event: error` once a stream has
started). As in Anthropic's API, `usage.input_tokens` counts the prompt tokens that were not read
from the KV cache; `cache_read_input_tokens` the ones that were; count_tokens gives their sum.
"""

import json
import re
import uuid

from twisted.web.server import NOT_DONE_YET

from krafla_twisted.api.errors import InvalidRequest, Unsupported
from krafla_twisted.api.resources import (Endpoint, NotFoundResource, QueuedReply, Reply, call_ids, json_response,
                                         require_chat)
from krafla_twisted.api.schema import MAX_STOP_STRINGS, json_type, parse_chat_request, parse_json_body
from krafla_twisted.api.sse import EventStream
from krafla_twisted.api.worker import Job
from krafla_twisted.generation.scheduler import Pending

ROLES = ("user", "assistant")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}   # and "tool", which names one


# ---------------------------------------------------------------------------------------------
# Errors


def error_type(error):
    """Anthropic's error type for an APIError, by its HTTP status."""
    status = error.status
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status in (503, 529):
        return "overloaded_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(error):
    return {"type": "error", "error": {"type": error_type(error), "message": error.message}}


class AnthropicErrors:
    """Mixed into a resource or a reply: every error it writes has Anthropic's shape."""

    def error_body(self, error):
        return error_body(error)


# ---------------------------------------------------------------------------------------------
# The request


def _text(value, where):
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: must be a string, not {json_type(value)}", param=where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{where}: holds a lone UTF-16 surrogate, which is not a character", param=where) from None
    return value


def _object(value, where):
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: must be an object, not {json_type(value)}", param=where)
    return value


def _block_type(block, where):
    kind = _object(block, where).get("type")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type: Field required (a string)", param=f"{where}.type")
    return kind


def _text_blocks(value, where, allowed=("text",)):
    """OpenAI text parts of a string or a list of text blocks (other `allowed` types are skipped)."""
    if isinstance(value, str):
        return [{"type": "text", "text": _text(value, where)}]
    if not isinstance(value, list):
        raise InvalidRequest(f"{where}: must be a string or an array of text blocks, not {json_type(value)}", param=where)
    parts = []
    for index, block in enumerate(value):
        at = f"{where}.{index}"
        kind = _block_type(block, at)
        if kind not in allowed:
            raise _bad_block(kind, at, allowed)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text")})
    return parts


def _bad_block(kind, where, allowed):
    names = ", ".join(repr(name) for name in allowed)
    if kind in ("image", "document", "search_result", "server_tool_use", "web_search_tool_result", "container_upload"):
        return Unsupported(f"{where}: this server reads only text; {kind!r} blocks cannot be used here "
                           f"(allowed: {names})", param=where)
    return InvalidRequest(f"{where}.type: {kind!r} is not a block type this message can hold (allowed: {names})",
                          param=f"{where}.type")


def _document(block, where):
    """The text parts of a plain-text document block: its `title` and `context` (when given) on lines of
    their own, a blank line, its text, from a `text` source (`data`) or a `content` source (a string or
    text blocks), and a blank line, so what follows is not run into it. Other sources (PDFs, URLs,
    files) are not text this server can read."""
    source = _object(block.get("source"), f"{where}.source")
    kind = source.get("type")
    if kind == "text":
        body = [{"type": "text", "text": _text(source.get("data"), f"{where}.source.data")}]
    elif kind == "content":
        body = _text_blocks(source.get("content"), f"{where}.source.content")
    else:
        raise Unsupported(f"{where}.source: this server reads only text; a document's source must be of type 'text' "
                          f"or 'content', not {kind!r}", param=f"{where}.source")
    head = [_text(block[name], f"{where}.{name}") for name in ("title", "context") if block.get(name) is not None]
    return ([{"type": "text", "text": "\n".join(head) + "\n\n"}] if head else []) + body + [{"type": "text", "text": "\n\n"}]


def _system(body):
    system = body.get("system")
    if system is None:
        return []
    parts = _text_blocks(system, "system")
    return [{"role": "system", "content": parts}] if parts else []


def _user(content, where):
    """The OpenAI messages of one user turn: its text, and one `tool` message per tool_result, in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": _text(content, f"{where}.content")}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or an array of blocks, not {json_type(content)}",
                             param=f"{where}.content")
    out, parts = [], None
    for index, block in enumerate(content):
        at = f"{where}.content.{index}"
        kind = _block_type(block, at)
        if kind in ("text", "document"):
            if parts is None:
                parts = []
                out.append({"role": "user", "content": parts})
            if kind == "text":
                parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text")})
            else:
                parts.extend(_document(block, at))
        elif kind == "tool_result":
            parts = None
            call_id = _text(block.get("tool_use_id"), f"{at}.tool_use_id")
            result = block.get("content", "")
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise InvalidRequest(f"{at}.is_error: must be a boolean, not {json_type(is_error)}", param=f"{at}.is_error")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_blocks(result, f"{at}.content")})
        else:
            raise _bad_block(kind, at, ("text", "document", "tool_result"))
    return out or [{"role": "user", "content": ""}]


def _assistant(content, where):
    """The OpenAI message of one assistant turn: its text, and its tool_use blocks as tool_calls.
    Thinking blocks a client sends back are dropped (templates drop earlier turns' reasoning)."""
    if isinstance(content, str):
        return [{"role": "assistant", "content": _text(content, f"{where}.content")}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content: must be a string or an array of blocks, not {json_type(content)}",
                             param=f"{where}.content")
    parts, calls = [], []
    for index, block in enumerate(content):
        at = f"{where}.content.{index}"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text")})
        elif kind == "tool_use":
            call_id = _text(block.get("id"), f"{at}.id")
            name = _text(block.get("name"), f"{at}.name")
            arguments = _object(block.get("input"), f"{at}.input")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _bad_block(kind, at, ("text", "tool_use", "thinking", "redacted_thinking"))
    message = {"role": "assistant", "content": parts}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _messages(body):
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("messages: Field required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(f"messages: must be an array, not {json_type(messages)}", param="messages")
    if not messages:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    out = []
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        role = _object(message, where).get("role")
        if role not in ROLES:
            raise InvalidRequest(f"{where}.role: must be \"user\" or \"assistant\", not {json.dumps(role)}",
                                 param=f"{where}.role")
        if "content" not in message:
            raise InvalidRequest(f"{where}.content: Field required", param=f"{where}.content")
        out += (_user if role == "user" else _assistant)(message["content"], where)
    return out


def _tools(body):
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools: must be an array, not {json_type(tools)}", param="tools")
    out = []
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        kind = _object(tool, where).get("type", "custom")
        if kind != "custom":
            raise Unsupported(f"{where}.type: {json.dumps(kind)} is one of Anthropic's own tools; this server "
                              f"takes only client tools (name, description, input_schema)", param=f"{where}.type")
        name = _text(tool.get("name"), f"{where}.name")
        if not TOOL_NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.name: must be 1 to 64 letters, digits, _ or -; got {name!r}",
                                 param=f"{where}.name")
        function = {"name": name, "parameters": _object(tool.get("input_schema"), f"{where}.input_schema")}
        if tool.get("description") is not None:
            function["description"] = _text(tool["description"], f"{where}.description")
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body, tools):
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice; as on the OpenAI
    endpoints one call per reply, unless `disable_parallel_tool_use` is false."""
    choice = body.get("tool_choice")
    if choice is None:
        return None, None
    kind = _block_type(choice, "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(f"tool_choice.disable_parallel_tool_use: must be a boolean, not {json_type(parallel)}",
                             param="tool_choice.disable_parallel_tool_use")
    if kind in ("any", "tool") and not tools:
        raise InvalidRequest(f"tool_choice.type: {kind!r} needs 'tools'", param="tool_choice")
    if kind == "tool":
        name = _text(choice.get("name"), "tool_choice.name")
        if name not in {tool["function"]["name"] for tool in tools}:
            raise InvalidRequest(f"tool_choice.name: {name!r} is not the name of one of the tools", param="tool_choice.name")
        openai_choice = {"type": "function", "function": {"name": name}}
    elif kind in TOOL_CHOICES:
        openai_choice = TOOL_CHOICES[kind]
    else:
        raise InvalidRequest(f"tool_choice.type: must be \"auto\", \"any\", \"tool\" or \"none\", not {kind!r}",
                             param="tool_choice.type")
    return openai_choice, parallel is False


def _stop_sequences(body):
    stops = body.get("stop_sequences")
    if stops is None:
        return None
    if not isinstance(stops, list):
        raise InvalidRequest(f"stop_sequences: must be an array of strings, not {json_type(stops)}", param="stop_sequences")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop_sequences: this server takes at most {MAX_STOP_STRINGS}; got {len(stops)}",
                             param="stop_sequences")
    for index, stop in enumerate(stops):
        if not _text(stop, f"stop_sequences.{index}"):
            raise InvalidRequest(f"stop_sequences.{index}: must not be empty", param="stop_sequences")
    return stops


def openai_body(body, count_only=False):
    """The OpenAI chat body an Anthropic Messages body means; InvalidRequest (with Anthropic's field
    names) on the first field that is wrong. `count_only` (count_tokens): max_tokens is not needed."""
    if not count_only and body.get("max_tokens") is None:
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream: must be a boolean, not {json_type(stream)}", param="stream")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest(f"metadata: must be an object, not {json_type(metadata)}", param="metadata")
    tools = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    out = {"messages": _system(body) + _messages(body)}
    fields = ("model", "temperature", "top_p", "top_k") if count_only else \
        ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")
    out.update({name: body[name] for name in fields if body.get(name) is not None})
    extra = {"stop": _stop_sequences(body), "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    out.update({name: value for name, value in extra.items() if value is not None})
    return out


def parse_messages_request(body, n_vocab, count_only=False):
    """The CompletionRequest of an Anthropic Messages body (checked as parse_chat_request checks a chat)."""
    return parse_chat_request(openai_body(body, count_only), n_vocab)


# ---------------------------------------------------------------------------------------------
# The reply


class MessagesReply(AnthropicErrors, Reply):
    """A Reply written in Anthropic's shape. Its job is the completion's, wrapped: on the worker it
    reports the prompt's length, which message_start carries."""

    def __init__(self, api, request, completion):
        super().__init__(api, request, completion)
        self.id = "msg_" + uuid.uuid4().hex[:24]
        if completion.stream:
            self.stream = EventStream(request, on_stop=self._client_gone, done=False)
        self.prompt_tokens = 0      # known once the job has rendered the prompt
        self.blocks = 0             # content blocks started in the stream
        self.text_block = None      # the index of the streamed text block, once started
        self.thinking_block = None  # the index of the streamed thinking block, once started
        self.thinking_done = False
        completion_work = self.job.work
        self.job = Job(lambda backend, cancelled: self._work(completion_work, backend, cancelled))

    def _work(self, completion_work, backend, cancelled):
        # The worker thread: touch nothing of the reply here but through call_in_reactor.
        pending = completion_work(backend, cancelled)
        if isinstance(pending, Pending):   # not a backend that answers at once
            self.api.worker.call_in_reactor(self._prompt_ready, len(pending.generation.prompt))
        return pending

    def _prompt_ready(self, prompt_tokens):
        self.prompt_tokens = prompt_tokens
        if self.stream is not None and not self.gone:
            self._ensure_stream_started()

    def _message(self, content, stop_reason, stop_sequence, usage):
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.api.backend.model_id,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def _anthropic_usage(result):
        return {"input_tokens": result.prompt_tokens - result.cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": result.cached_tokens,
                "output_tokens": result.completion_tokens}

    def _ensure_stream_started(self):
        if self.stream.started:
            return
        usage = {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                 "output_tokens": 0}
        self._event("message_start", message=self._message([], None, None, usage))
        self._event("ping")

    def _event(self, name, **fields):
        self.stream.send({"type": name, **fields}, name)

    def _content_piece(self, text):
        if self.tool_stream is not None:
            text = self.tool_stream.push(text)
        if text:
            self._text_delta(text)

    def _reasoning_piece(self, text):
        """A thinking template's reasoning: a `thinking` block, before the text block."""
        self._ensure_stream_started()
        if self.thinking_block is None:
            self.thinking_block = self._start_block({"type": "thinking", "thinking": "", "signature": ""})
        self._event("content_block_delta", index=self.thinking_block, delta={"type": "thinking_delta", "thinking": text})

    def _end_thinking(self):
        if self.thinking_block is not None and not self.thinking_done:
            self.thinking_done = True
            self._event("content_block_stop", index=self.thinking_block)

    def _text_delta(self, text):
        self._ensure_stream_started()
        self._end_thinking()
        if self.text_block is None:
            self.text_block = self._start_block({"type": "text", "text": ""})
        self._event("content_block_delta", index=self.text_block, delta={"type": "text_delta", "text": text})

    def _start_block(self, block):
        index, self.blocks = self.blocks, self.blocks + 1
        self._event("content_block_start", index=index, content_block=block)
        return index

    def _tool_uses(self, calls):
        return [{"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments}
                for call_id, call in zip(call_ids(self.completion, calls, "toolu_"), calls)]

    def _conclude(self, result, content, calls, reasoning=None):
        # the request's stop sequence the reply was cut at (not a template's own stop string)
        stop_sequence = getattr(result, "stop_string", None)
        stop_sequence = stop_sequence if stop_sequence in self.completion.stop else None
        if calls:
            stop_reason = "tool_use"
        elif result.finish_reason == "length":
            stop_reason = "max_tokens"
        else:
            stop_reason = "stop_sequence" if stop_sequence is not None else "end_turn"
        usage = self._anthropic_usage(result)
        if self.stream is None:
            blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
            blocks += [{"type": "text", "text": content}] if content else []
            blocks += self._tool_uses(calls)
            self._write_whole(json_response(self.request, self._message(blocks, stop_reason, stop_sequence, usage)))
            return
        self._ensure_stream_started()
        if self.tool_stream is not None:
            rest = self.tool_stream.finish(content)
            if rest:
                self._text_delta(rest)
        self._end_thinking()
        if self.text_block is not None:
            self._event("content_block_stop", index=self.text_block)
        for block in self._tool_uses(calls):
            index = self._start_block(dict(block, input={}))
            self._event("content_block_delta", index=index,
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
            self._event("content_block_stop", index=index)
        self._event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence}, usage=usage)
        self._event("message_stop")
        self.stream.end()

    def _stream_error(self, error):
        self.stream.send(self.error_body(error), "error")
        self.stream.end()


class CountReply(AnthropicErrors, QueuedReply):
    failing = "counting the tokens"

    def __init__(self, api, request, completion):
        super().__init__(api, request, lambda backend, cancelled: count_tokens(backend, completion))


def count_tokens(backend, completion):
    """{"input_tokens": N}: the prompt rendered exactly as a completion renders it (worker thread)."""
    try:
        prompt = backend.prompt(completion)
    except ValueError as e:   # ChatError: a conversation or tools the template cannot render
        raise InvalidRequest(str(e), param="tools" if completion.tools and backend.tool_format is None
                             else "messages") from None
    return {"input_tokens": len(prompt.tokens)}


# ---------------------------------------------------------------------------------------------
# The resources


class AnthropicNotFound(AnthropicErrors, NotFoundResource):
    pass


class Messages(AnthropicErrors, Endpoint):
    """POST /v1/messages; /v1/messages/count_tokens is its child."""

    methods = ("POST",)
    isLeaf = False

    def getChild(self, path, request):
        if path == b"" and not request.postpath:
            return self
        return AnthropicNotFound(self.api)

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        require_chat(self.api.backend, "/v1/completions", param="messages")
        completion = parse_messages_request(body, self.api.backend.n_vocab)
        self.api.admit()
        MessagesReply(self.api, request, completion).start()
        return NOT_DONE_YET


class CountTokens(AnthropicErrors, Endpoint):
    methods = ("POST",)

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        require_chat(self.api.backend, "/v1/completions", param="messages")
        completion = parse_messages_request(body, self.api.backend.n_vocab, count_only=True)
        self.api.admit()
        CountReply(self.api, request, completion).start()
        return NOT_DONE_YET
