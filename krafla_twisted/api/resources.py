"""The resources of /v1/chat/completions, /v1/completions, /v1/models[/ID] and /health, and what
every endpoint shares: the API object, the base resource (CORS, API key, method dispatch), and
QueuedReply, a request answered by a job on the worker. krafla_twisted/api/routes.py puts them in
one tree.

Every resource here runs in the I/O thread. The engine is reached only through the EngineWorker.
"""

import dataclasses
import hashlib
import json
import math
import uuid
from urllib.parse import unquote

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from krafla_twisted import __version__
from krafla_twisted.chat.templates import tool_json
from krafla_twisted.generation.reasoning import reasoning_close, reasoning_stream, reasoning_token_count, split_reply
from krafla_twisted.generation.tools import ToolStream
from krafla_twisted.api.errors import (
    APIError, InvalidRequest, MethodNotAllowed, NotFound, Overloaded, ServerError, ShuttingDown,
)
from krafla_twisted.api.schema import parse_chat_request, parse_completion_request, parse_json_body
from krafla_twisted.api.sse import EventStream
from krafla_twisted.api.worker import Job

log = Logger(namespace="krafla.api")


DEFAULT_MAX_QUEUE = 64  # --max-queue's default


class API:
    """What the resources share: the served model (`backend`), the worker, the access policy, a clock.

    `max_queue`: how many requests may wait beyond the ones being generated (one per slot,
    --parallel); more get 503.
    """

    def __init__(self, backend, worker, access, clock, max_queue=DEFAULT_MAX_QUEUE):
        self.backend = backend
        self.worker = worker
        self.access = access
        self.clock = clock
        self.created = int(clock.seconds())
        self.max_queue = max_queue
        self.slots = getattr(getattr(backend, "scheduler", None), "parallel", 1)
        self.replies = set()  # completions not yet answered in full
        self.stopping = False

    def admit(self):
        """Refuse new work: 503 when the server stops, 503 with Retry-After when `max_queue`
        requests wait already beyond the slots. This must be called in the I/O thread."""
        if self.stopping:
            raise ShuttingDown()
        pending = self.worker.pending()
        if pending - self.slots >= self.max_queue:
            raise Overloaded(pending)

    def shutdown(self):
        """The server stops: no new work; every reply in flight ends now, with an error a client can read."""
        self.stopping = True
        for reply in list(self.replies):
            reply.shut_down()

    def model_object(self):
        return {"id": self.backend.model_id, "object": "model", "created": self.created, "owned_by": "krafla"}


def json_response(request, payload, status=200):
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json")
    # A lone surrogate (a \ud800 escape in the request, echoed in an error message) is written as the
    # same JSON escape: backslashreplace spells it \ud800, valid JSON, where plain utf-8 would raise.
    return json.dumps(payload, ensure_ascii=False).encode("utf-8", "backslashreplace")


def error_response(request, error, body=None):
    """The error's status, headers and body: `body` in the shape of the request's API (OpenAI's,
    error.body(), when not given)."""
    for name, value in error.headers:
        request.setHeader(name, value)
    return json_response(request, error.body() if body is None else body, error.status)


def require_chat(backend, instead, param=None):
    """A 400 unless the served model has a chat template: `instead` names what the server answers then."""
    if not backend.has_chat:
        raise InvalidRequest(f"This server has no chat template, so it answers only {instead}; start it with "
                             "--chat TEMPLATE", param=param, code="chat_not_available")


def _path(request):
    return request.path.decode("ascii", "replace")


class APIResource(Resource):
    """Base of every node: CORS, preflight, the body limit, the API key, then method dispatch.

    Subclasses list their methods in `methods` and implement `render_<METHOD>`; an APIError raised
    there becomes its response, shaped by `error_body` (OpenAI's shape; another API's resource
    overrides it).
    """

    methods = ()
    needs_key = True

    def __init__(self, api):
        super().__init__()
        self.api = api

    def error_body(self, error):
        """The JSON body of an error answered here."""
        return error.body()

    def render(self, request):
        access = self.api.access
        try:
            access.check_host(request)
        except APIError as error:
            return error_response(request, error, self.error_body(error))
        access.add_cors_headers(request)
        if request.method == b"OPTIONS":
            return access.preflight(request)
        try:
            if request.body_error is not None:
                raise request.body_error
            if self.needs_key:
                access.check_key(request)
            return self.dispatch(request)
        except APIError as error:
            return error_response(request, error, self.error_body(error))
        except Exception:
            # A bug: log it with its traceback, answer in the API's shape rather than an HTML page.
            log.failure("error handling {method} {path}", method=request.method, path=_path(request))
            error = ServerError("internal server error")
            return error_response(request, error, self.error_body(error))

    def dispatch(self, request):
        method = request.method.decode("ascii", "replace")
        if method == "HEAD" and "GET" in self.methods:
            method = "GET"
        if method not in self.methods:
            raise MethodNotAllowed(method, _path(request), self.methods)
        return getattr(self, f"render_{method}")(request)

    def getChild(self, path, request):
        return NotFoundResource(self.api)


class NotFoundResource(APIResource):
    """Any path that is not an endpoint: 404 (after the key check, so it reveals nothing)."""

    isLeaf = True

    def dispatch(self, request):
        raise NotFound(f"Invalid URL ({request.method.decode('ascii', 'replace')} {_path(request)})")


class Endpoint(APIResource):
    """A leaf: a trailing slash is accepted, deeper paths are 404."""

    isLeaf = True

    def dispatch(self, request):
        if request.postpath not in ([], [b""]):
            return NotFoundResource.dispatch(self, request)
        return super().dispatch(request)


class Health(Endpoint):
    methods = ("GET",)
    needs_key = False

    def render_GET(self, request):
        return json_response(request, {"status": "ok"})


class Models(APIResource):
    methods = ("GET",)

    def render_GET(self, request):
        return json_response(request, {"object": "list", "data": [self.api.model_object()]})

    def getChild(self, path, request):
        if path == b"":
            return self
        return Model(self.api, "/".join(unquote(part.decode("utf-8", "replace")) for part in [path, *request.postpath]))


class Model(APIResource):
    methods = ("GET",)
    isLeaf = True

    def __init__(self, api, model_id):
        super().__init__(api)
        self.model_id = model_id

    def render_GET(self, request):
        if self.model_id != self.api.backend.model_id:
            raise NotFound(f"The model '{self.model_id}' does not exist", param="model", code="model_not_found")
        return json_response(request, self.api.model_object())


class Completions(Endpoint):
    """POST a completion request; the reply is one JSON object, or server-sent events with stream."""

    methods = ("POST",)

    def __init__(self, api, kind):
        super().__init__(api)
        self.kind = kind

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        backend = self.api.backend
        if self.kind == "chat":
            require_chat(backend, "/v1/completions")
            completion = parse_chat_request(body, backend.n_vocab)
        else:
            completion = parse_completion_request(body, backend.n_vocab)
        self.api.admit()
        if completion.n == 1 and not completion.batch and completion.best_of <= 1:
            Reply(self.api, request, completion).start()
        else:
            Choices(self.api, request, completion).start()
        return NOT_DONE_YET


class Group(APIResource):
    """A path segment that is not an endpoint itself (/v1, /chat): 404 when asked directly."""

    dispatch = NotFoundResource.dispatch


class QueuedReply:
    """A request answered by one job on the worker, with one JSON body. I/O thread, except where noted.

    `work(backend, cancelled)` runs in the worker thread; `answer(result)` turns its result into the
    JSON payload. At shutdown (or if the job fails) the client gets the error instead, its body
    shaped by `error_body` (OpenAI's shape; another API's reply overrides it).
    """

    failing = "the request"  # "... failed: <the error>" in a 500's message

    def __init__(self, api, request, work):
        self.api = api
        self.request = request
        self.gone = False
        self.job = Job(work)

    def start(self):
        self.api.replies.add(self)
        self.request.notifyFinish().addBoth(self._request_over)
        self.api.worker.submit(self.job).addCallbacks(self._finished, self._failed)

    def _request_over(self, result):
        # The response is finished, or the connection is gone: this reply needs no more care.
        self.api.replies.discard(self)
        if isinstance(result, Failure):
            self._client_gone()

    def _client_gone(self, _=None):
        self.gone = True
        self.job.cancel()

    def shut_down(self):
        """SIGTERM: stop the job and answer 503 now; the worker's later result is ignored."""
        if self.gone:
            return
        self._client_gone()
        self._write_error(ShuttingDown())

    def answer(self, result):
        return result

    def error_body(self, error):
        """The JSON body of an error this reply answers with."""
        return error.body()

    def _write_error(self, error):
        self._write_whole(error_response(self.request, error, self.error_body(error)))

    def _finished(self, result):
        if self.gone or result is None:
            return
        self._write_whole(json_response(self.request, self.answer(result)))

    def _failed(self, failure):
        if self.gone:
            return
        self._write_error(self._api_error(failure))

    def _api_error(self, failure):
        error = failure.value
        if not isinstance(error, APIError):
            log.failure("{path} failed", failure, path=_path(self.request))
            error = ServerError(f"{self.failing} failed: {error}")
        return error

    def _write_whole(self, body):
        write_whole(self.request, body)


def write_whole(request, body):
    """Send `body` (bytes) as the whole response and finish it."""
    request.setHeader(b"content-length", str(len(body)).encode("ascii"))
    request.write(body)
    request.finish()


def call_ids(completion, calls, prefix):
    """The ids of a reply's tool calls: `prefix` and 24 hex digits of a hash of the request's
    messages and tools and of the call itself with its place in the reply. An id is unique within a
    conversation (each turn's messages differ) and the same request gets the same ids, so a client
    that writes earlier calls' ids back into the prompt as text (smolagents' ToolCallingAgent does)
    sees a reply that a re-run reproduces bit for bit, as the rest of krafla's replies are."""
    conversation = json.dumps([completion.messages, completion.tools], sort_keys=True, default=repr)
    ids = []
    for index, call in enumerate(calls):
        digest = hashlib.sha256(json.dumps([conversation, index, call.name, call.arguments], sort_keys=True,
                                           default=repr).encode("utf-8"))
        ids.append(prefix + digest.hexdigest()[:24])
    return ids


def token_logprobs(entries):
    """(bytes, logprob, top) entries as a list of {"token", "logprob", "bytes", "top_logprobs"}, one per
    token: the chat's `logprobs.content`, the Responses API's and Ollama's `logprobs`."""
    def item(piece, value):
        return {"token": piece.decode("utf-8", "replace"), "logprob": value, "bytes": list(piece)}

    return [{**item(piece, value), "top_logprobs": [item(p, v) for p, v in top]} for piece, value, top in entries]


class Reply(QueuedReply):
    """One completion request in flight, from queueing to the last byte. I/O thread, except where noted."""

    failing = "generation"

    def __init__(self, api, request, completion):
        on_text = self._text_from_worker if completion.stream else None
        # Streamed logprobs travel beside the text; otherwise they come back in the result.
        streamed_logprobs = completion.stream and completion.logprobs is not None
        extra = {"on_logprobs": self._logprobs_from_worker} if streamed_logprobs else {}
        super().__init__(api, request,
                         lambda backend, cancelled: backend.begin(completion, on_text, cancelled, **extra))
        self.completion = completion
        self.chat = completion.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(api.clock.seconds())
        self.stream = self._event_stream() if completion.stream else None
        self.pending_logprobs = []   # streamed: entries of tokens whose text is not sent yet
        self.text_offset = 0         # completions' logprobs.text_offset of the next token
        tool_format = getattr(api.backend, "tool_format", None) if self.chat else None
        self.tool_format = tool_format if completion.tools and completion.tool_choice != "none" else None
        self.tool_stream = ToolStream(self.tool_format) if self.tool_format and completion.stream else None
        # A thinking template's reply is REASONING</think>ANSWER (gpt-oss's: analysis and final
        # channels): the answer is the content (tool calls are read from it), the reasoning goes to
        # each API's own field (generation.reasoning).
        template = getattr(api.backend, "template", None) if self.chat else None
        self.template = template
        self.thinking = getattr(template, "thinking", False)
        self.reasoning_stream = reasoning_stream(template) if self.thinking and completion.stream else None
        self.reasoning_tokens = 0   # how many of the reply's tokens were reasoning, once it is done

    def _event_stream(self):
        """What the streamed reply's chunks go through: the response's own event stream."""
        return EventStream(self.request, on_stop=self._client_gone)

    def start(self):
        self.request.work_pending = True
        super().start()

    def shut_down(self):
        """SIGTERM: stop the job and end the response now. A started stream ends with an error event
        and [DONE]; otherwise the client gets a 503. The worker's later result is ignored."""
        if self.gone:
            return
        self._client_gone()
        error = ShuttingDown()
        if self.stream is not None and self.stream.started:
            self._stream_error(error)
        else:
            self._write_error(error)

    def _text_from_worker(self, text):
        # Runs in the worker thread: hand the piece to the reactor, touch nothing here.
        self.api.worker.call_in_reactor(self._piece, text)

    def _logprobs_from_worker(self, entries):
        # Runs in the worker thread, just before the text of these tokens. The list is looked up in the
        # reactor, not here: a chunk sent in between replaces it (speculation emits several tokens per step).
        self.api.worker.call_in_reactor(self._add_logprobs, entries)

    def _add_logprobs(self, entries):
        self.pending_logprobs.extend(entries)

    def _piece(self, text):
        if self.gone or not text:
            return
        if self.reasoning_stream is not None:
            reasoning, text = self.reasoning_stream.push(text)
            if reasoning:
                self._reasoning_piece(reasoning)
        if text:
            self._content_piece(text)

    def _reasoning_piece(self, text):
        """Stream a piece of the reasoning (Chat Completions: `delta.reasoning_content`)."""
        self._ensure_stream_started()
        chunk = self._chunk(None, None, logprobs=self._take_logprobs())
        chunk["choices"][0]["delta"] = {"reasoning_content": text}
        self.stream.send(chunk)

    def _content_piece(self, text):
        """Stream a piece of the answer (its tool calls held back)."""
        if self.tool_stream is not None:
            text = self.tool_stream.push(text)
            if not text:
                return
        self._ensure_stream_started()
        self.stream.send(self._chunk(text, None, logprobs=self._take_logprobs()))

    def _take_logprobs(self):
        """The logprobs of the tokens sampled since the last chunk, for the next one (None: none)."""
        if self.completion.logprobs is None or not self.pending_logprobs:
            return None
        entries, self.pending_logprobs = self.pending_logprobs, []
        return self._logprobs(entries)

    def _logprobs(self, entries):
        """OpenAI's logprobs object for these (bytes, logprob, top) entries."""
        if self.chat:
            return {"content": token_logprobs(entries), "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece, value, top in entries:
            token = piece.decode("utf-8", "replace")
            out["tokens"].append(token)
            out["token_logprobs"].append(value)
            # an echoed prompt's first token has no logprob and no alternatives (null)
            out["top_logprobs"].append(None if top is None else {p.decode("utf-8", "replace"): v for p, v in top})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(token)
        return out

    def _tool_calls(self, calls):
        return [{"id": call_id, "type": "function", "function": {"name": call.name, "arguments": tool_json(call.arguments)}}
                for call_id, call in zip(call_ids(self.completion, calls, "call_"), calls)]

    def _ensure_stream_started(self):
        if not self.stream.started and self.chat:
            self.stream.send(self._chunk(None, None, role=True))
        self.stream.start()

    def _chunk(self, text, finish_reason, role=False, logprobs=None, tool_calls=None):
        if self.chat:
            delta = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            kind = "text_completion"
        chunk = self._envelope(kind)
        chunk["choices"] = [choice]
        if self.completion.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, kind):
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.api.backend.model_id,
            "system_fingerprint": f"krafla-{__version__}",
        }

    def _usage(self, result):
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def _job_over(self, result):
        """The worker is done with this reply's job (`result` None: skipped or failed)."""
        if result is not None:
            self.request.completion_stats = result
        self.request.work_done()

    def _finished(self, result):
        self._job_over(result)
        if self.gone or result is None or result.finish_reason == "cancelled":
            return
        text, reasoning = result.text, None
        if self.thinking:
            reasoning, text = split_reply(self.template, result.text)
            if reasoning:
                self.reasoning_tokens = reasoning_token_count(self.api.backend.token_pieces(result.tokens),
                                                              reasoning_close(self.template))
            if self.reasoning_stream is not None:   # what the stream still holds goes out first
                rest_reasoning, rest = self.reasoning_stream.finish()
                if rest_reasoning:
                    self._reasoning_piece(rest_reasoning)
                if rest:
                    self._content_piece(rest)
        content, calls = text, []
        if self.tool_format is not None:
            content, calls = self.tool_format.parse(text, self.completion.tools)
        self._conclude(result, content, calls, reasoning or None)

    def _conclude(self, result, content, calls, reasoning=None):
        """Write the end of the reply: its text `content` without the tool calls, the `calls` parsed
        out of it, and a thinking template's `reasoning` (None: none) before them (each API spells
        these its own way; this is OpenAI's Chat and text Completions)."""
        finish_reason = "tool_calls" if calls else result.finish_reason
        if self.stream is not None:
            self._ensure_stream_started()
            if self.tool_stream is not None:
                rest = self.tool_stream.finish(content)
                if rest:
                    self.stream.send(self._chunk(rest, None, logprobs=self._take_logprobs()))
                if calls:
                    deltas = [dict(call, index=index) for index, call in enumerate(self._tool_calls(calls))]
                    self.stream.send(self._chunk(None, None, tool_calls=deltas, logprobs=self._take_logprobs()))
            self.stream.send(self._chunk(None, finish_reason, logprobs=self._take_logprobs()))
            if self.completion.include_usage:
                usage = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
                usage["choices"] = []
                usage["usage"] = self._usage(result)
                self.stream.send(usage)
            self.stream.end()
            return
        reply = self._envelope("chat.completion" if self.chat else "text_completion")
        logprobs = self._logprobs(result.logprobs) if self.completion.logprobs is not None else None
        if self.chat:
            message = {"role": "assistant", "content": content, "refusal": None}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = self._tool_calls(calls)
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": finish_reason}
        reply["choices"] = [choice]
        reply["usage"] = self._usage(result)
        self._deliver(reply)

    def _deliver(self, reply):
        """Send the whole (not streamed) reply object."""
        self._write_whole(json_response(self.request, reply))

    def _failed(self, failure):
        self._job_over(None)
        if self.gone:
            return
        error = self._api_error(failure)
        if self.stream is not None and self.stream.started:
            # The head is sent: the error can only travel as an event, then the stream ends.
            self._stream_error(error)
            return
        self._write_error(error)

    def _stream_error(self, error):
        """End a started stream with the error as its last event (a dialect names its own event)."""
        self.stream.send(self.error_body(error))
        self.stream.end()


def choice_requests(completion):
    """The one-reply requests of `completion`'s candidates, prompt by prompt: `n` replies for each
    prompt of a batch (or the one prompt, or the chat), or `best_of` to choose the n from (with
    logprobs, which ranking needs)."""
    prompts = completion.batch or ((completion.prompt_text, completion.prompt_tokens),)
    made = max(completion.n, completion.best_of)
    logprobs = completion.logprobs if made == completion.n or completion.logprobs is not None else 0
    return [dataclasses.replace(completion, prompt_text=text, prompt_tokens=tokens, batch=(), n=1, best_of=1,
                                choice=choice, logprobs=logprobs)
            for text, tokens in prompts for choice in range(made)]


def mean_logprob(choice):
    """best_of's rank of a reply: its tokens' mean logprob (OpenAI's "highest log probability per
    token"); a reply of no tokens ranks last."""
    values = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return sum(values) / len(values) if values else -math.inf


class Choices:
    """A request with several choices (`n` above 1, or a batch of prompts): each choice is a
    ChoiceReply, a job of its own that joins the scheduler as any request does (side by side with
    --parallel), and they answer as one response whose choices carry their index. Not streamed,
    it is written once every choice is done; streamed, the choices' chunks go out as they come,
    each with its index, and the stream ends (with the usage of all of them) after the last.
    An error in any choice is the response's; the others are cancelled. I/O thread."""

    def __init__(self, api, request, completion):
        self.api = api
        self.request = request
        self.n = max(completion.n, completion.best_of)   # candidates per prompt
        self.keep = completion.n                          # of which the response gives the best `keep`
        self.strip_logprobs = completion.logprobs is None  # asked for only to rank them
        completions = choice_requests(completion)
        first = completions[0]
        self.chat = first.kind == "chat"
        self.include_usage = first.include_usage
        self.stream = EventStream(request, on_stop=self._client_gone) if first.stream else None
        self.members = [ChoiceReply(self, index, completion) for index, completion in enumerate(completions)]
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(api.clock.seconds())
        self.replies = {}        # index -> the choice's whole reply (not streamed)
        self.usages = {}         # index -> its usage
        self.results = {}        # index -> its GenerationResult, for the log line
        self.jobs_left = len(self.members)
        self.ends_left = len(self.members)
        self.over = False        # the response is written, failed, or its client left

    def start(self):
        self.request.work_pending = True
        self.api.replies.add(self)
        self.request.notifyFinish().addBoth(self._request_over)
        for member in self.members:
            member.start()

    def _request_over(self, result):
        self.api.replies.discard(self)
        if isinstance(result, Failure):
            self._client_gone()

    def _client_gone(self, _=None):
        self.over = True
        for member in self.members:
            member._client_gone()

    def shut_down(self):
        """SIGTERM: every choice stops; the client gets the 503 (or, streamed, the error event)."""
        if not self.over:
            self.fail(ShuttingDown())

    def job_over(self, index, result):
        if result is not None:
            self.results[index] = result
        self.jobs_left -= 1
        if self.jobs_left == 0:
            if self.results:
                self.request.completion_stats = self._combined_stats()
            self.request.work_done()

    def _combined_stats(self):
        """One GenerationResult for the log line and /metrics: the choices' tokens summed (each
        prompt's once), the first choice's timings."""
        results = [self.results[i] for i in sorted(self.results)]
        firsts = [self.results[i] for i in sorted(self.results) if i % self.n == 0] or results[:1]
        return dataclasses.replace(results[0], prompt_tokens=sum(r.prompt_tokens for r in firsts),
                                   cached_tokens=sum(r.cached_tokens for r in firsts),
                                   completion_tokens=sum(r.completion_tokens for r in results),
                                   proposed_tokens=sum(r.proposed_tokens for r in results),
                                   accepted_tokens=sum(r.accepted_tokens for r in results))

    def _usage(self):
        """The usage of the whole response: each prompt's tokens once, every choice's reply tokens."""
        usages = [self.usages[i] for i in sorted(self.usages)]
        firsts = [self.usages[i] for i in sorted(self.usages) if i % self.n == 0]
        prompt = sum(u["prompt_tokens"] for u in firsts)
        completion = sum(u["completion_tokens"] for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)},
            "completion_tokens_details": {
                "reasoning_tokens": sum(u["completion_tokens_details"]["reasoning_tokens"] for u in usages)},
        }

    def deliver(self, index, reply):
        """A choice's whole reply (not streamed); the response is written with the last."""
        if self.over:
            return
        self.replies[index] = reply
        self.usages[index] = reply["usage"]
        if len(self.replies) < len(self.members):
            return
        self.over = True
        response = dict(self.replies[0])
        response["choices"] = self._best_choices()
        response["usage"] = self._usage()
        write_whole(self.request, json_response(self.request, response))

    def _best_choices(self):
        """The response's choices: for each prompt, its candidates' best `keep` by mean logprob (ties to
        the earlier), or all of them when there is no choosing; indexed in order."""
        choices = []
        for first in range(0, len(self.members), self.n):
            candidates = [self.replies[i]["choices"][0] for i in range(first, first + self.n)]
            if self.keep < self.n:
                ranked = sorted(range(self.n), key=lambda i: (-mean_logprob(candidates[i]), i))
                candidates = [candidates[i] for i in ranked[:self.keep]]
            choices += candidates
        return [dict(choice, index=index, **({"logprobs": None} if self.strip_logprobs and self.keep < self.n else {}))
                for index, choice in enumerate(choices)]

    def send(self, index, chunk):
        """A choice's streamed chunk: its choice takes the choice's index; its usage chunk is held for the end."""
        if self.over:
            return
        if not chunk.get("choices") and chunk.get("usage"):
            self.usages[index] = chunk["usage"]
            return
        for choice in chunk["choices"]:   # the id and created time are the group's already (ChoiceReply._envelope)
            choice["index"] = index
        self.stream.send(chunk)

    def end(self, index):
        """A choice's stream ended; the response's ends after the last (with the usage of all, if asked)."""
        self.ends_left -= 1
        if self.over or self.ends_left:
            return
        self.over = True
        if self.include_usage:
            usage = self.members[0]._envelope("chat.completion.chunk" if self.chat else "text_completion")
            usage["choices"] = []
            usage["usage"] = self._usage()
            self.stream.send(usage)
        self.stream.end()

    def fail(self, error):
        """A choice failed (or the server stops): the others are cancelled and the client gets the error,
        as a last event once the stream has started."""
        if self.over:
            return
        self._client_gone()
        if self.stream is not None and self.stream.started:
            self.stream.send(self.members[0].error_body(error))
            self.stream.end()
            return
        write_whole(self.request, error_response(self.request, error, self.members[0].error_body(error)))


class ChoiceStream:
    """What a ChoiceReply streams through: its chunks go to the response's stream with its index."""

    def __init__(self, group, index):
        self.group = group
        self.index = index
        self.started = False     # per choice: each chat choice's first chunk carries the role

    def start(self):
        self.started = True
        if not self.group.over:
            self.group.stream.start()

    def send(self, chunk):
        self.started = True
        self.group.send(self.index, chunk)

    def end(self):
        self.group.end(self.index)


class ChoiceReply(Reply):
    """One choice of a Choices response: a Reply whose output goes to the group instead of the request."""

    def __init__(self, group, index, completion):
        self.group = group
        self.index = index
        super().__init__(group.api, group.request, completion)

    def _event_stream(self):
        return ChoiceStream(self.group, self.index)

    def start(self):
        self.api.worker.submit(self.job).addCallbacks(self._finished, self._failed)

    def _envelope(self, kind):
        envelope = super()._envelope(kind)
        envelope["id"], envelope["created"] = self.group.id, self.group.created
        return envelope

    def _job_over(self, result):
        self.group.job_over(self.index, result)

    def _deliver(self, reply):
        self.group.deliver(self.index, reply)

    def _write_error(self, error):
        self.group.fail(error)

    def _stream_error(self, error):
        self.group.fail(error)
