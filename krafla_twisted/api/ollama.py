"""Ollama's API under /api, as Open WebUI, Continue, LangChain's ChatOllama and the ollama libraries call it.

    POST /api/chat  POST /api/generate  GET /api/tags  POST /api/show  GET /api/ps  GET /api/version
    POST /api/embed  POST /api/embeddings (legacy)  (api/embeddings.py: a server started with --embeddings)
    /api/pull /api/push /api/create /api/copy /api/delete /api/blobs/*  -> 501 (models are not managed over HTTP)

Nothing here generates, samples or streams on its own. A body is translated into the OpenAI-shaped
fields that schema.parse_chat_request / parse_completion_request read (so it is checked by the same
code as /v1, and any error message names Ollama's field, `options.num_predict` rather than
`max_tokens`), and the CompletionRequest is answered by OllamaReply, a resources.Reply: the same
queue, limits, generator, tool-call parsing, API key, CORS, metrics and log line. Only the shapes
are Ollama's: NDJSON chunks (streamed unless `"stream": false`), a last chunk with `done: true`,
the counts and the durations in nanoseconds, and errors as `{"error": "message"}`. A reply with
`"stream": false` is the same chunks folded into one object, so it cannot differ from the streamed one.

With one model served, any model name is accepted (as on /v1) and replies carry the served model's id.
"""

import dataclasses
import datetime
import hashlib
import os
import time

from twisted.web.server import NOT_DONE_YET

from krafla_twisted import __version__
from krafla_twisted.api import schema
from krafla_twisted.api.errors import APIError, InvalidRequest, Unsupported
from krafla_twisted.api.embeddings import EmbeddingsOnly, embedding_runtime, ollama_embed_work
from krafla_twisted.api.resources import (APIResource, Endpoint, Group, NotFoundResource, QueuedReply, Reply, json_response,
                                          require_chat, token_logprobs)
from krafla_twisted.api.schema import parse_chat_request, parse_completion_request, parse_json_body
from krafla_twisted.api.sse import EventStream

# Ollama's options -> the fields of the OpenAI-shaped body that the schema parsers read.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
# The names the schema's error messages use, as an Ollama client wrote them.
RENAMED = {**{field: f"options.{option}" for option, field in OPTIONS.items()}, "response_format": "format"}
UNLIMITED = (-1, -2)  # num_predict: no limit but the context (-2, "fill the context", is the same here)

NOT_MANAGED = ("krafla does not manage models over HTTP: start the server with the model file "
               "(twistd krafla MODEL.mlb -z TOKENIZER.mlt), or fetch a known model with `krafla pull NAME`")
NEVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at: the model stays loaded as long as the server runs


def rfc3339(seconds):
    """A POSIX time as RFC 3339 in UTC, to the microsecond, as Ollama writes created_at."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def error_body(error):
    """Ollama's error shape: `{"error": "message"}` (the status says the rest)."""
    return {"error": error.message}


class OllamaErrors:
    """Mixed into a resource or a reply: every error it writes has Ollama's shape."""

    def error_body(self, error):
        return error_body(error)


# ---------------------------------------------------------------------------------------------
# Bodies: Ollama's fields onto the one CompletionRequest


def _type(value):
    return schema.json_type(value)


def _string(body, name):
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string, not {_type(value)}", param=name)
    return value


def _common(body):
    """`model` (any name: one model is served), `stream` (true unless false) and `keep_alive` (ignored)."""
    _string(body, "model")
    stream = body.get("stream")
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'stream' must be a boolean, not {_type(stream)}", param="stream")
    return stream


def _response_format(body):
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "schema": value}
    raise InvalidRequest(f"'format' must be \"json\" or a JSON schema (an object), not {_type(value)}"
                         + (f" {value!r}" if isinstance(value, str) else ""), param="format")


def _options(body, n_ctx):
    """The OpenAI-shaped fields of `options`, and whether num_predict asks for no limit.
    Options krafla has no use for (num_gpu, mirostat, ...) are ignored, as Ollama ignores unknown ones."""
    options = body.get("options")
    if options is None:
        return {}, False
    if not isinstance(options, dict):
        raise InvalidRequest(f"'options' must be an object, not {_type(options)}", param="options")
    fields = {OPTIONS[name]: value for name, value in options.items() if name in OPTIONS and value is not None}
    unlimited = False
    predict = fields.get("max_tokens")
    if schema.is_number(predict) and predict in UNLIMITED:
        del fields["max_tokens"]
        unlimited = True
    elif schema.is_number(predict) and predict < 1:
        raise InvalidRequest(f"'options.num_predict' must be at least 1, or -1 for no limit but the context; "
                             f"got {predict}", param="options.num_predict")
    seed = fields.get("seed")
    if schema.is_number(seed) and seed < 0:
        del fields["seed"]  # Ollama's -1: a random seed, which is the server's default (unless -s)
    num_ctx = options.get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, float) and num_ctx.is_integer():
            num_ctx = int(num_ctx)
        if not schema.is_int(num_ctx) or num_ctx < 1:
            raise InvalidRequest(f"'options.num_ctx' must be a positive integer, not {_type(num_ctx)} {num_ctx!r}",
                                 param="options.num_ctx")
        if num_ctx > n_ctx:
            raise InvalidRequest(f"'options.num_ctx' is {num_ctx}, more than this server's context of {n_ctx} "
                                 f"tokens (its --ctx); ask for at most {n_ctx} or restart the server with a "
                                 f"larger --ctx", param="options.num_ctx")
    return fields, unlimited


def _translated(parse, fields, body, backend):
    """`fields` (the OpenAI-shaped body so far) with the options, parsed by `parse` into the
    CompletionRequest, with `format` and num_predict's "no limit" set on it. Always streamed
    inside: a reply with "stream": false is the folded chunks."""
    options, unlimited = _options(body, backend.n_ctx)
    response_format = _response_format(body)
    logprobs = _logprobs(body)
    try:
        completion = parse({**fields, **options}, backend.n_vocab)
    except InvalidRequest as error:
        raise _renamed(error) from None
    changes = {"stream": True, "response_format": response_format, "logprobs": logprobs}
    if unlimited:
        changes["max_tokens"] = 0  # the Generation's "until the context is full"
    return dataclasses.replace(completion, **changes)


def _logprobs(body):
    """How many alternatives `logprobs: true` asks for at each token (`top_logprobs`, 0 to 20), or None
    without it."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequest(f"'logprobs' must be a boolean, not {_type(wanted)}", param="logprobs")
    if top is not None and (not schema.is_int(top) or not 0 <= top <= schema.MAX_TOP_LOGPROBS):
        raise InvalidRequest(f"'top_logprobs' must be an integer from 0 to {schema.MAX_TOP_LOGPROBS}, not {top!r}",
                             param="top_logprobs")
    if top and not wanted:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _renamed(error):
    """The schema's error with Ollama's field names in its message and param."""
    for field, name in RENAMED.items():
        error.message = error.message.replace(f"'{field}'", f"'{name}'")
        if error.param == field:
            error.param = name
    return error


def _message(message, where):
    """One Ollama message as the OpenAI-shaped one the schema reads (content a string, no images)."""
    if not isinstance(message, dict):
        raise InvalidRequest(f"'{where}' must be an object, not {_type(message)}", param=where)
    if message.get("images"):
        raise Unsupported(f"'{where}.images': krafla serves text models and reads no images; send text only",
                          param=f"{where}.images")
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"'{where}.content' must be a string, not {_type(content)}", param=f"{where}.content")
    out = {"role": message.get("role"), "content": content}
    if message.get("tool_calls") is not None:
        out["tool_calls"] = message["tool_calls"]  # {function: {name, arguments: object}}: the schema reads these
    if out["role"] == "tool":
        # Ollama names the tool a result comes from (tool_name), where OpenAI names the call.
        name = message.get("tool_name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequest(f"'{where}.tool_name' must be a string, not {_type(name)}", param=f"{where}.tool_name")
        out["tool_call_id"] = name or ""
    return out


def chat_request(body, backend):
    """(CompletionRequest, streamed) of an /api/chat body; the request is None when there are no
    messages, Ollama's way to load a model."""
    streamed = _common(body)
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise InvalidRequest(f"'messages' must be an array, not {_type(messages)}", param="messages")
    if not messages:
        return None, streamed
    fields = {"messages": [_message(message, f"messages[{index}]") for index, message in enumerate(messages)]}
    if body.get("tools") is not None:
        fields["tools"] = body["tools"]
    return _translated(parse_chat_request, fields, body, backend), streamed


def generate_request(body, backend):
    """(CompletionRequest, streamed) of an /api/generate body; the request is None for an empty
    prompt (Ollama's way to load a model). `raw` (or a server without a chat template) continues
    the prompt as it is; otherwise `system` and `prompt` are a chat of one user message."""
    streamed = _common(body)
    if _string(body, "template"):
        raise Unsupported("'template': krafla does not take its own chat template in a request; the server's chat "
                          "template (--chat) renders every prompt", param="template")
    if body.get("images"):
        raise Unsupported("'images': krafla serves text models and reads no images; send text only", param="images")
    if body.get("context"):
        raise Unsupported("'context' (the token ids of an earlier reply, deprecated by Ollama) is not supported; "
                          "send the conversation to /api/chat instead", param="context")
    prompt = _string(body, "prompt") or ""
    system = _string(body, "system")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise InvalidRequest(f"'raw' must be a boolean, not {_type(raw)}", param="raw")
    suffix = _string(body, "suffix")
    if suffix:  # fill in the middle: the reply goes between the prompt and the suffix, with no chat around them
        if system:
            raise InvalidRequest("'system' cannot be used with 'suffix': a fill-in-the-middle prompt is the code "
                                 "before and after the insertion only", param="system")
        return _translated(parse_completion_request, {"prompt": prompt, "suffix": suffix}, body, backend), streamed
    if not prompt:
        return None, streamed
    if raw or not backend.has_chat:
        if system:
            why = "with 'raw': true the prompt is sent as it is" if raw else "this server has no chat template (--chat)"
            raise InvalidRequest(f"'system' cannot be used: {why}; put it in the prompt", param="system")
        return _translated(parse_completion_request, {"prompt": prompt}, body, backend), streamed
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return _translated(parse_chat_request, {"messages": messages}, body, backend), streamed


# ---------------------------------------------------------------------------------------------
# Replies


class WholeReply:
    """What stands for the stream of a reply with "stream": false: the chunks are collected and
    written at the end folded into one object. It never counts as started, so an error (or
    shutdown) before the end is an ordinary HTTP error."""

    started = False

    def __init__(self, reply):
        self.reply = reply
        self.chunks = []

    def start(self):
        pass

    def send(self, payload, name=None):
        self.chunks.append(payload)

    def end(self):
        reply = self.reply
        reply._write_whole(json_response(reply.request, fold(self.chunks)))


def fold(chunks):
    """Streamed chunks as Ollama's one reply: the last chunk with all the text (and tool calls, and
    log probabilities)."""
    whole = dict(chunks[-1])
    logprobs = [entry for chunk in chunks for entry in chunk.get("logprobs", ())]
    if logprobs:
        whole["logprobs"] = logprobs
    if "message" in whole:
        message = {"role": "assistant", "content": "".join(chunk["message"]["content"] for chunk in chunks)}
        thinking = "".join(chunk["message"].get("thinking", "") for chunk in chunks)
        if thinking:
            message["thinking"] = thinking
        calls = [call for chunk in chunks for call in chunk["message"].get("tool_calls", ())]
        if calls:
            message["tool_calls"] = calls
        whole["message"] = message
    else:
        whole["response"] = "".join(chunk["response"] for chunk in chunks)
        thinking = "".join(chunk.get("thinking", "") for chunk in chunks)
        if thinking:
            whole["thinking"] = thinking
    return whole


class OllamaReply(OllamaErrors, Reply):
    """A Reply whose chunks are Ollama's. `endpoint` "chat" puts the text in `message`, "generate"
    in `response` (whatever the request's kind: a templated generate is a chat inside);
    `arrived` (time.monotonic_ns()) is when the request came in, for total_duration."""

    def __init__(self, api, request, completion, *, streamed, endpoint, arrived):
        super().__init__(api, request, completion)
        self.endpoint = endpoint
        self.arrived = arrived
        self.result = None
        if streamed:
            self.stream = EventStream(request, on_stop=self._client_gone, done=False, ndjson=True)
        else:
            self.stream = WholeReply(self)

    def _ensure_stream_started(self):
        self.stream.start()  # no first chunk with the role: Ollama has none

    def _reasoning_piece(self, text):
        """A thinking template's reasoning: `message.thinking` (chat) or `thinking` (generate)."""
        self._ensure_stream_started()
        chunk = self._chunk(None, None)
        (chunk["message"] if self.endpoint == "chat" else chunk)["thinking"] = text
        self.stream.send(chunk)

    def _tool_calls(self, calls):
        return [{"function": {"name": call.name, "arguments": call.arguments}} for call in calls]

    def _finished(self, result):
        self.result = result  # for the counts of the last chunk
        super()._finished(result)

    def _logprobs(self, entries):
        """Ollama's logprobs of these (bytes, logprob, top) entries: a list, one object per token."""
        return token_logprobs(entries)

    def _chunk(self, text, finish_reason, role=False, logprobs=None, tool_calls=None):
        chunk = {"model": self.api.backend.model_id, "created_at": rfc3339(self.api.clock.seconds())}
        if self.endpoint == "chat":
            message = {"role": "assistant", "content": text or ""}
            if tool_calls:
                message["tool_calls"] = [{"function": call["function"]} for call in tool_calls]
            chunk["message"] = message
        else:
            chunk["response"] = text or ""
        if logprobs:
            chunk["logprobs"] = logprobs
        chunk["done"] = finish_reason is not None
        if finish_reason is not None:
            chunk.update(self._counts(finish_reason))
        return chunk

    def _counts(self, finish_reason):
        result = self.result
        return {
            "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": time.monotonic_ns() - self.arrived,
            "load_duration": 0,  # the model was loaded when the server started
            "prompt_eval_count": result.prompt_tokens,
            "prompt_eval_duration": round(result.prompt_seconds * 1e9),
            "eval_count": result.completion_tokens,
            "eval_duration": round(result.generation_seconds * 1e9),
        }


# ---------------------------------------------------------------------------------------------
# Resources


class OllamaNotFound(OllamaErrors, NotFoundResource):
    """A path under /api that is not an endpoint: 404 in Ollama's shape."""


class OllamaGroup(OllamaErrors, Group):
    """/api (and /api/blobs's parent): 404 when asked directly or for an unknown child."""

    def getChild(self, path, request):
        return OllamaNotFound(self.api)


class OllamaEndpoint(OllamaErrors, Endpoint):
    pass


class Generate(OllamaEndpoint):
    """POST /api/chat ("chat") or /api/generate ("generate")."""

    methods = ("POST",)

    def __init__(self, api, endpoint):
        super().__init__(api)
        self.endpoint = endpoint

    def render_POST(self, request):
        arrived = time.monotonic_ns()
        body = parse_json_body(request.content.read())
        backend = self.api.backend
        if self.endpoint == "chat":
            require_chat(backend, '/api/generate with "raw": true')
            completion, streamed = chat_request(body, backend)
        else:
            completion, streamed = generate_request(body, backend)
        if completion is None:
            return json_response(request, self._loaded())
        self.api.admit()
        OllamaReply(self.api, request, completion, streamed=streamed, endpoint=self.endpoint, arrived=arrived).start()
        return NOT_DONE_YET

    def _loaded(self):
        """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
        reply = {"model": self.api.backend.model_id, "created_at": rfc3339(self.api.clock.seconds())}
        if self.endpoint == "chat":
            reply["message"] = {"role": "assistant", "content": ""}
        else:
            reply["response"] = ""
        reply.update(done=True, done_reason="load")
        return reply


def model_facts(api):
    """What /api/tags, /api/show and /api/ps say of the served model: its name, file size, an
    identifier (`digest`: sha256 of the file's path, size and modification time, not of its
    content, which would take seconds to read), modified_at and Ollama's `details`."""
    backend = api.backend
    model = getattr(getattr(backend, "runtime", None), "model", None)
    path = getattr(model, "path", None)
    try:
        stat = os.stat(path) if path else None
    except OSError:
        stat = None
    size = stat.st_size if stat else getattr(model, "n_bytes", 0)
    mtime = stat.st_mtime if stat else api.created
    identity = f"{path}\0{size}\0{stat.st_mtime_ns if stat else 0}".encode("utf-8", "replace")
    arch = getattr(model, "arch", "") or ""
    n_params = getattr(model, "n_params", 0) or 0
    details = {
        "parent_model": "",
        "format": "mlb",
        "family": arch,
        "families": [arch] if arch else None,
        "parameter_size": parameter_size(n_params) if n_params else "",
        "quantization_level": quantization_level(model),
    }
    return {
        "name": backend.model_id,
        "model": backend.model_id,
        "modified_at": rfc3339(mtime),
        "size": size,
        "digest": hashlib.sha256(identity).hexdigest(),
        "details": details,
    }


def quantization_level(model):
    """Ollama's `quantization_level`: the file type the model was converted as (its `file_type`
    metadata, e.g. `Q4_K_M`, docs/formats.md), else, for a file converted before krafla recorded
    it, the type of its first layer's first matrix."""
    info = getattr(model, "info", None) or {}
    return str(info.get("file_type") or getattr(model, "weight_type", "") or "").upper()


def parameter_size(n_params):
    """A parameter count as Ollama writes it: "134.52M", "7.6B"."""
    if n_params >= 10**9:
        return f"{n_params / 10**9:.1f}B"
    return f"{n_params / 10**6:.2f}M"


class Tags(OllamaEndpoint):
    """GET /api/tags: the one served model."""

    methods = ("GET",)

    def render_GET(self, request):
        return json_response(request, {"models": [model_facts(self.api)]})


class Ps(OllamaEndpoint):
    """GET /api/ps: the one served model, loaded for as long as the server runs."""

    methods = ("GET",)

    def render_GET(self, request):
        facts = model_facts(self.api)
        running = {key: facts[key] for key in ("name", "model", "size", "digest", "details")}
        running.update(expires_at=NEVER, size_vram=0, context_length=self.api.backend.n_ctx)
        return json_response(request, {"models": [running]})


class Version(OllamaEndpoint):
    """GET /api/version: krafla's version."""

    methods = ("GET",)

    def render_GET(self, request):
        return json_response(request, {"version": __version__})


class Show(OllamaEndpoint):
    """POST /api/show: the details, the model's hyperparameters as `model_info` (with Ollama's GGUF
    key names), the server's sampling defaults as `parameters`, and the chat template's name."""

    methods = ("POST",)

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        _string(body, "model")
        _string(body, "name")  # the older name of the field
        backend = self.api.backend
        facts = model_facts(self.api)
        template = getattr(backend, "template", None)
        capabilities = ["completion"] + (["tools"] if getattr(backend, "tool_format", None) else []) \
            + (["insert"] if getattr(backend, "fills_in", False) else [])  # Ollama's word for `suffix`
        if getattr(backend, "embeddings", None) is not None:  # --embeddings: Ollama's word for it
            capabilities = ["embedding"]
        parameters = self._parameters(backend, template)
        return json_response(request, {
            "modelfile": f"# krafla serves this model file\nFROM {self._path(backend)}\n"
                         + "".join(f"PARAMETER {line}\n" for line in parameters),
            "parameters": "\n".join(parameters),
            "template": template.name if template is not None else "",
            "license": "",
            "details": facts["details"],
            "model_info": self._model_info(backend, facts),
            "capabilities": capabilities,
            "modified_at": facts["modified_at"],
        })

    @staticmethod
    def _path(backend):
        return getattr(getattr(getattr(backend, "runtime", None), "model", None), "path", backend.model_id)

    @staticmethod
    def _parameters(backend, template):
        """Modelfile PARAMETER lines: the server's sampling defaults, its context and the template's stops."""
        sampling = getattr(getattr(backend, "runtime", None), "sampling", None)
        lines = []
        if sampling is not None:
            lines += [f"temperature {sampling.temperature:g}", f"top_p {sampling.top_p:g}", f"top_k {sampling.top_k}",
                      f"repeat_penalty {sampling.repeat_penalty:g}", f"repeat_last_n {sampling.repeat_last_n}"]
            lines += [f"{name} {value:g}" for name, value in (("min_p", sampling.min_p),
                                                               ("frequency_penalty", sampling.frequency_penalty),
                                                               ("presence_penalty", sampling.presence_penalty)) if value]
            if sampling.seed is not None:
                lines.append(f"seed {sampling.seed}")
        lines.append(f"num_ctx {backend.n_ctx}")
        for stop in (template.stop_strings if template is not None else ()):
            lines.append(f'stop "{stop}"')
        return lines

    @staticmethod
    def _model_info(backend, facts):
        model = getattr(getattr(backend, "runtime", None), "model", None)
        info = getattr(model, "info", None) or {}
        arch = facts["details"]["family"] or "unknown"
        out = {"general.architecture": arch, "general.name": getattr(model, "name", backend.model_id),
               "general.parameter_count": getattr(model, "n_params", 0),
               f"{arch}.context_length": getattr(model, "max_seq", backend.n_ctx),
               f"{arch}.vocab_size": backend.n_vocab}
        for key, name in (("dim", "embedding_length"), ("n_layers", "block_count"), ("ffn_dim", "feed_forward_length"),
                          ("n_heads", "attention.head_count"), ("n_kv_heads", "attention.head_count_kv"),
                          ("norm_eps", "attention.layer_norm_rms_epsilon"), ("rope_theta", "rope.freq_base")):
            if key in info:
                out[f"{arch}.{name}"] = info[key]
        return out


class OllamaQueuedReply(OllamaErrors, QueuedReply):
    """A one-body job's reply with Ollama's error shape."""


class OllamaEmbeddingsOnly(OllamaErrors, EmbeddingsOnly):
    """/api/chat and /api/generate of a server started for embeddings: 400 in Ollama's shape."""


class Embed(OllamaEndpoint):
    """POST /api/embed, or the legacy POST /api/embeddings (`legacy`): api/embeddings.py's job."""

    methods = ("POST",)

    def __init__(self, api, legacy):
        super().__init__(api)
        self.legacy = legacy

    def render_POST(self, request):
        work = ollama_embed_work(parse_json_body(request.content.read()), self.legacy, self.api.backend.model_id)
        embedding_runtime(self.api.backend)
        self.api.admit()
        OllamaQueuedReply(self.api, request, work).start()
        return NOT_DONE_YET


class Refused(OllamaErrors, APIResource):
    """Any method on a path (and below it: /api/blobs/DIGEST) that krafla answers with 501 and
    `message` (model management)."""

    isLeaf = True

    def __init__(self, api, message):
        super().__init__(api)
        self.message = message

    def dispatch(self, request):
        raise APIError(self.message, status=501, code="not_implemented")


def build_ollama(api):
    """The /api tree: mount it as the root's b"api" child (not under /v1, as Ollama has it)."""
    root = OllamaGroup(api)
    if getattr(api.backend, "embeddings", None) is not None:  # --embeddings: no text generation
        root.putChild(b"chat", OllamaEmbeddingsOnly(api))
        root.putChild(b"generate", OllamaEmbeddingsOnly(api))
    else:
        root.putChild(b"chat", Generate(api, "chat"))
        root.putChild(b"generate", Generate(api, "generate"))
    root.putChild(b"tags", Tags(api))
    root.putChild(b"show", Show(api))
    root.putChild(b"ps", Ps(api))
    root.putChild(b"version", Version(api))
    for name in (b"pull", b"push", b"create", b"copy", b"delete", b"blobs"):
        root.putChild(name, Refused(api, NOT_MANAGED))
    root.putChild(b"embed", Embed(api, legacy=False))
    root.putChild(b"embeddings", Embed(api, legacy=True))
    return root
