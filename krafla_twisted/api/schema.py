"""Request bodies: parse, check every field the server reads, refuse what it cannot do.

Each check raises InvalidRequest (400) naming the field in `param`, so no body can reach the
engine with a value of the wrong type or range. Fields the server does not use (user, metadata,
...) are ignored, as the original says.
"""

import json
import math
import re
from dataclasses import dataclass, field

from krafla_twisted.api.errors import InvalidRequest, Unsupported

MAX_STOP_STRINGS = 4
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHOICES = 128  # replies one request may ask for: `n` of them for each prompt of a batch


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields a request set; None means the server's default (its -T, -p, ... options)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """One validated request: `kind` is "chat" (messages) or "text" (prompt_text or prompt_tokens)."""

    kind: str
    messages: tuple = ()
    prompt_text: str | None = None
    prompt_tokens: tuple | None = None
    suffix: str | None = None           # fill in the middle: the reply goes between prompt_text and this
    echo: bool = False                  # text completions: the reply follows the prompt (with its logprobs)
    max_tokens: int | None = None
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    logit_bias: dict = field(default_factory=dict)   # {token id: -100..100}
    ignore_eos: bool = False            # llama-server's and vLLM's: the end-of-reply tokens are never sampled
    logprobs: int | None = None         # None: no log probabilities; else how many alternatives (0-20)
    response_format: dict | None = None  # None (text), {"type": "json_object"} or {"type": "json_schema", "schema": S}
    grammar: str | None = None          # llama-server's: a GBNF grammar the reply follows
    tools: tuple = ()                   # OpenAI tool objects ({"type": "function", "function": {...}})
    tool_choice: str = "auto"           # "auto", "none", "required" or the name of a function to call
    parallel_tool_calls: bool = False    # several calls in one reply only when asked for (as llama-server)
    n: int = 1                          # replies to make (for each prompt of a batch); choice i's seed is seed + i
    best_of: int = 1                    # text completions: make this many, return the n of highest mean logprob
    batch: tuple = ()                   # text completions: (prompt_text, prompt_tokens) of each prompt, when several
    choice: int = 0                     # which of the n replies this request is (resources.Choices splits them)

    @property
    def requires_call(self):
        """The reply must be a tool call: tools are given and tool_choice is "required" or a function's name."""
        return bool(self.tools) and self.tool_choice not in ("auto", "none")


def parse_json_body(body):
    """The request body as a JSON object, or InvalidRequest."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object")
    try:
        value = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float,
                           object_pairs_hook=_object_without_duplicates)
    except DuplicateKey as e:
        raise InvalidRequest(f"The JSON body repeats the key {e.key!r} in one object; send each key once",
                             param=e.key) from None
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"The request body must be a JSON object, not {json_type(value)}")
    _check_depth(value)
    return value


MAX_JSON_DEPTH = 32  # a request needs 5 levels; deeper bodies are refused before any code walks them


def _check_depth(value):
    """Refuse arrays and objects nested deeper than MAX_JSON_DEPTH (walked without recursion), so no
    later step (an error message quoting a value, a log line) can hit Python's recursion limit."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"The JSON body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values() if isinstance(child, (dict, list)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a number")
    return value


class DuplicateKey(ValueError):
    """A JSON object names one key twice. Parsers disagree on which value wins (first, last, an
    error), so a proxy and this server could read different requests: refuse instead of choosing."""

    def __init__(self, key):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _object_without_duplicates(pairs):
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return value


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def json_type(value):
    """How an error message names a JSON value's type: "null", "a boolean", "a number", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def check_text(text, where):
    """JSON can carry lone surrogates (\\ud800), which are not text: refuse them here, not in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{where}' holds a lone UTF-16 surrogate, which is not a character", param=where) from None
    return text


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value):
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _integer(body, name, low, high=None):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 64.0 is an integer in JSON
    if not is_int(value):
        raise InvalidRequest(f"'{name}' must be an integer, not {json_type(value)}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InvalidRequest(f"'{name}' must be {bound}; got {value}", param=name)
    return value


def _number(body, name, low, high=None, *, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise InvalidRequest(f"'{name}' must be a number, not {json_type(value)}", param=name)
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        lower = f"above {low}" if low_open else f"at least {low}"
        bound = f"{lower} and at most {high}" if high is not None else lower
        raise InvalidRequest(f"'{name}' must be {bound}; got {value}", param=name)
    return float(value)


def _boolean(body, name):
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean, not {json_type(value)}", param=name)
    return value


def _sampling(body):
    penalty_name = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    seed = _integer(body, "seed", -(2**63), UINT64_MAX)
    return SamplingOverrides(
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_integer(body, "top_k", 0, INT32_MAX),
        repeat_penalty=_number(body, penalty_name, 0.0, FLOAT32_MAX, low_open=True),  # the sampler's float
        repeat_last_n=_integer(body, "repeat_last_n", -1, INT32_MAX),
        seed=None if seed is None else seed & UINT64_MAX,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        min_p=_number(body, "min_p", 0.0, 1.0),
    )


def _generation_fields(body, n_vocab, fewest_tokens=1):
    """The fields both endpoints read the same way (in this order, after the messages or the prompt)."""
    return {"max_tokens": _max_tokens(body, fewest_tokens), "sampling": _sampling(body), "stop": _stop(body),
            "logit_bias": _logit_bias(body, n_vocab), "ignore_eos": _boolean(body, "ignore_eos")}


def _max_tokens(body, fewest=1):
    # max_completion_tokens is the newer name; when both are set it wins, as in OpenAI's API.
    newer = _integer(body, "max_completion_tokens", fewest)
    older = _integer(body, "max_tokens", fewest)
    return newer if newer is not None else older


def _stop(body):
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidRequest(f"'stop' must be a string or an array of strings, not {json_type(value)}", param="stop")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings; got {len(value)}", param="stop")
    for item in value:
        if not isinstance(item, str):
            raise InvalidRequest(f"each 'stop' entry must be a string, not {json_type(item)}", param="stop")
        if not item:
            raise InvalidRequest("'stop' strings must not be empty", param="stop")
        check_text(item, "stop")
    return tuple(value)


def _stream(body):
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidRequest(f"'stream_options' must be an object, not {json_type(options)}", param="stream_options")
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise InvalidRequest(
            f"'stream_options.include_usage' must be a boolean, not {json_type(include_usage)}",
            param="stream_options.include_usage",
        )
    return stream, bool(include_usage)


def _common_checks(body):
    """The fields every request has: `model`, and `n`, which is returned."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, not {json_type(model)}", param="model")
    return _integer(body, "n", 1, MAX_CHOICES) or 1


def parse_chat_request(body, n_vocab):
    """A validated chat request from a parsed JSON object (InvalidRequest on the first bad field);
    logit_bias's token ids are checked against the vocabulary size."""
    n = _common_checks(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest(f"'logprobs' must be a boolean, not {json_type(logprobs)}", param="logprobs")
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list):
            raise InvalidRequest(f"'functions' must be an array, not {json_type(functions)}", param="functions")
        if functions:
            raise Unsupported("'functions' is OpenAI's retired form of tools; send 'tools' instead", param="functions")
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest(f"'parallel_tool_calls' must be a boolean, not {json_type(parallel)}",
                             param="parallel_tool_calls")
    stream, include_usage = _stream(body)
    return CompletionRequest(
        n=n,
        kind="chat",
        messages=_messages(body),
        **_generation_fields(body, n_vocab),
        stream=stream,
        include_usage=include_usage,
        logprobs=(top_logprobs or 0) if logprobs else None,
        **_format_fields(body, tools and tool_choice != "none"),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel is True,
    )


def _logit_bias(body, n_vocab):
    """OpenAI's logit_bias: {"token id": bias from -100 to 100}, each id below `n_vocab`."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"'logit_bias' must be an object of token ids to numbers, not {json_type(value)}",
                             param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            token = None
        if token is None or str(token) != key.strip() or token < 0:
            raise InvalidRequest(f"'logit_bias' keys must be token ids (integers >= 0); got {key!r}", param="logit_bias")
        if not is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"'logit_bias[{key}]' must be a number from -100 to 100; got {json.dumps(bias)}",
                                 param="logit_bias")
        out[token] = float(bias)
    bad = next((token for token in out if token >= n_vocab), None)
    if bad is not None:
        raise InvalidRequest(f"'logit_bias' names token {bad}, which is not a token id (0 to {n_vocab - 1})",
                             param="logit_bias")
    return out


def _format_fields(body, has_tools):
    """response_format and grammar: OpenAI's response_format, or llama-server's `json_schema` (a
    schema, the same as response_format json_schema) or `grammar` (GBNF); one of them at most, and a
    grammar not beside tools (both would decide the reply's shape)."""
    response_format = _response_format(body)
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise InvalidRequest(f"'json_schema' must be an object (a JSON schema), not {json_type(schema)}",
                                 param="json_schema")
        if response_format is not None:
            raise InvalidRequest("'json_schema' and 'response_format' both shape the reply: send one", param="json_schema")
        response_format = {"type": "json_schema", "schema": schema}
    text = body.get("grammar")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequest(f"'grammar' must be a string (a GBNF grammar), not {json_type(text)}", param="grammar")
        text = check_text(text, "grammar") if text.strip() else None
    if text is not None and (response_format is not None or has_tools):
        raise InvalidRequest("'grammar' cannot be used with " + ("'tools'" if has_tools else "a JSON schema or "
                             "'response_format'") + ": each decides the reply's shape", param="grammar")
    return {"response_format": response_format, "grammar": text}


def _response_format(body):
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"'response_format' must be an object, not {json_type(value)}", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("'response_format.json_schema' must be an object with 'name' and 'schema'",
                                 param="response_format.json_schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(f"'response_format.json_schema.name' must be a string, not {json_type(name)}",
                                 param="response_format.json_schema.name")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"'response_format.json_schema.schema' must be an object, not {json_type(schema)}",
                                 param="response_format.json_schema.schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(f"'response_format.json_schema.strict' must be a boolean, not {json_type(strict)}",
                                 param="response_format.json_schema.strict")
        return {"type": "json_schema", "schema": {} if schema is True else schema}
    raise InvalidRequest(f"'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
                         f"not {json.dumps(kind)}", param="response_format.type")


def _tools(body):
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise InvalidRequest(f"'tools' must be an array, not {json_type(tools)}", param="tools")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise InvalidRequest(f"'{where}' must be an object, not {json_type(tool)}", param=where)
        if tool.get("type") != "function":
            raise InvalidRequest(f"'{where}.type' must be \"function\"; got {json.dumps(tool.get('type'))}",
                                 param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"'{where}.function' must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"'{where}.function.name' must be 1 to 64 letters, digits, _ or -; got {json.dumps(name)}",
                                 param=f"{where}.function.name")
        if name in names:
            raise InvalidRequest(f"'{where}.function.name' repeats the tool name {name!r}", param=f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"'{where}.function.parameters' must be a JSON schema object", param=f"{where}.function.parameters")
        description = function.get("description")
        if description is not None:
            check_text(description if isinstance(description, str) else "", f"{where}.function.description")
    return tuple(tools)


_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _tool_choice(body, tools):
    value = body.get("tool_choice")
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise InvalidRequest(f"'tool_choice' must be \"auto\", \"none\", \"required\" or a function; got {value!r}",
                                 param="tool_choice")
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        choice = value["function"]["name"]
        if choice not in {t["function"]["name"] for t in tools}:
            raise InvalidRequest(f"'tool_choice' names the function {choice!r}, which is not in 'tools'",
                                 param="tool_choice")
    else:
        raise InvalidRequest("'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                             param="tool_choice")
    if choice != "none" and choice != "auto" and not tools:
        raise InvalidRequest(f"'tool_choice' {choice!r} needs 'tools'", param="tool_choice")
    return choice


def _messages(body):
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(f"'messages' must be an array, not {json_type(messages)}", param="messages")
    if not messages:
        raise InvalidRequest("'messages' must hold at least one message", param="messages")
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"'{where}' must be an object, not {json_type(message)}", param=where)
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"'{where}.role' must be a string, not {json_type(role)}", param=f"{where}.role")
        if role == "function":
            raise Unsupported(f"'{where}.role' \"function\" is OpenAI's retired form; send \"tool\" messages",
                              param=f"{where}.role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}", param=f"{where}.role"
            )
        item = {"role": role}
        content = message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            item["tool_calls"] = _message_tool_calls(calls, f"{where}.tool_calls")
            if content is None:
                content = ""
        elif calls is not None and calls != []:
            raise InvalidRequest(f"'{where}.tool_calls' is only for assistant messages", param=f"{where}.tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"'{where}.tool_call_id' must be the id of the call this answers, a string",
                                     param=f"{where}.tool_call_id")
            item["tool_call_id"] = call_id
        item["content"] = _content(content, f"{where}.content")
        result.append(item)
    return tuple(result)


def _message_tool_calls(calls, where):
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}' must be an array, not {json_type(calls)}", param=where)
    out = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"'{at}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                                 param=at)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise InvalidRequest(f"'{at}.function.arguments' is not JSON: {e}", param=f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"'{at}.function.arguments' must be a JSON object", param=f"{at}.function.arguments")
        out.append({"function": {"name": function["name"], "arguments": arguments}})
    return out


def _content(content, where):
    if isinstance(content, str):
        return check_text(content, where)
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or an array of text parts, not {json_type(content)}", param=where)
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"'{part_where}' must be an object, not {json_type(part)}", param=part_where)
        kind = part.get("type")
        if kind != "text":
            if isinstance(kind, str):
                raise Unsupported(f"This server reads only text; '{part_where}.type' cannot be {kind!r}", param=part_where)
            raise InvalidRequest(f"'{part_where}.type' must be \"text\"", param=part_where)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"'{part_where}.text' must be a string, not {json_type(text)}", param=part_where)
        texts.append(check_text(text, part_where))
    # Parts are pieces of one message; they are joined as written, with nothing added between them.
    return "".join(texts)


def parse_completion_request(body, n_vocab):
    """A validated text completion request; token ids (the prompt's, logit_bias's) are checked
    against the vocabulary size."""
    n = _common_checks(body)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequest(f"'echo' must be a boolean, not {json_type(echo)}", param="echo")
    echo = bool(echo)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest(f"'suffix' must be a string, not {json_type(suffix)}", param="suffix")
    suffix = check_text(suffix, "suffix") if suffix else None
    if echo and suffix is not None:
        raise InvalidRequest("'echo' and 'suffix' cannot be used together: the reply of a fill in the middle "
                             "goes between two texts, not after the prompt", param="echo")
    best_of = _integer(body, "best_of", 1, MAX_CHOICES) or n
    if best_of < n:
        raise InvalidRequest(f"'best_of' ({best_of}) must be at least 'n' ({n}): the n best of best_of replies are "
                             "returned", param="best_of")
    logprobs = body.get("logprobs")
    if logprobs is not None and not (is_int(logprobs) or isinstance(logprobs, bool)):
        raise InvalidRequest(f"'logprobs' must be an integer, not {json_type(logprobs)}", param="logprobs")
    if logprobs is not None and not isinstance(logprobs, bool) and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequest(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}; got {logprobs}", param="logprobs")
    batch = _prompts(body.get("prompt"), n_vocab)
    if len(batch) * best_of > MAX_CHOICES:
        name = "best_of" if best_of > n else "n"
        raise InvalidRequest(f"'{name}' times the number of prompts is at most {MAX_CHOICES}; got {best_of} x {len(batch)}",
                             param=name)
    prompt_text, prompt_tokens = batch[0]
    if suffix is not None and any(tokens is not None for _, tokens in batch):
        raise InvalidRequest("'suffix' goes with a text prompt, not with token ids: the text before the insertion "
                             "and 'suffix' the text after it", param="suffix")
    stream, include_usage = _stream(body)
    if best_of > n and stream:
        raise InvalidRequest("'best_of' cannot be streamed: the best replies are known only once all are done",
                             param="best_of")
    return CompletionRequest(
        n=n,
        best_of=best_of,
        batch=batch if len(batch) > 1 else (),
        kind="text",
        prompt_text=prompt_text,
        prompt_tokens=prompt_tokens,
        suffix=suffix,
        # with echo, max_tokens 0 asks for the prompt alone (its logprobs, as lm-evaluation-harness does)
        **_generation_fields(body, n_vocab, fewest_tokens=0 if echo else 1),
        stream=stream,
        include_usage=include_usage,
        logprobs=None if logprobs is None or logprobs is False else int(logprobs),
        echo=echo,
        **_format_fields(body, False),
    )


def _prompts(prompt, n_vocab):
    """((text, None) or (None, token ids)) of each prompt: `prompt` is a string, an array of token
    ids, or a batch: an array of strings or of token id arrays (OpenAI's four forms)."""
    if prompt is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        if len(prompt) > MAX_CHOICES:
            raise InvalidRequest(f"'prompt' holds at most {MAX_CHOICES} prompts; got {len(prompt)}", param="prompt")
        return tuple(_prompt(item, n_vocab, f"prompt[{index}]") for index, item in enumerate(prompt))
    return (_prompt(prompt, n_vocab, "prompt"),)


def _prompt(prompt, n_vocab, where):
    if isinstance(prompt, str):
        return check_text(prompt, where), None
    if not isinstance(prompt, list):
        raise InvalidRequest(f"'{where}' must be a string or an array of token ids, not {json_type(prompt)}", param="prompt")
    if not prompt:
        raise InvalidRequest(f"'{where}' must not be an empty array", param="prompt")
    if any(isinstance(item, (str, list)) for item in prompt):
        raise InvalidRequest(f"'{where}' must be a string or an array of token ids, not an array of arrays",
                             param="prompt")
    for index, token in enumerate(prompt):
        if not is_int(token):
            raise InvalidRequest(f"'{where}[{index}]' must be a token id (an integer), not {json_type(token)}", param="prompt")
        if not 0 <= token < n_vocab:
            raise InvalidRequest(f"'{where}[{index}]' is {token}, not a token id (0 to {n_vocab - 1})", param="prompt")
    return None, tuple(prompt)
