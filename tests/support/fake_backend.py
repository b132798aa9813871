"""Test doubles for the HTTP layer's in-memory tests: a scripted backend and a synchronous one-thread pool.

Never imported by product code. APIHarness also takes the real backend (krafla_twisted.api.backend)
over a tiny model, whose Scheduler it then watches step by step (tests/test_hardening_parallel.py);
the real backend over the real model is tested in tests/test_server_*.py.
"""

import json
from dataclasses import dataclass

from treq.testing import StubTreq
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionLost
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure

from krafla_twisted.api.access import Access
from krafla_twisted.api.errors import ContextTooLong
from krafla_twisted.api.resources import API
from krafla_twisted.api.routes import build_root
from krafla_twisted.api.site import APISite
from krafla_twisted.api.worker import EngineWorker


@dataclass
class FakeResult:
    """The fields of krafla_twisted.generation.generate.GenerationResult the HTTP layer reads."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prompt_seconds: float = 0.5
    generation_seconds: float = 0.25
    tokens: tuple = ()          # the "token ids": each piece's index in FakeBackend.pieces
    proposed_tokens: int = 0    # speculative decoding's counts (none: the fake does not speculate)
    accepted_tokens: int = 0


@dataclass
class FakePrompt:
    """The field of krafla_twisted.generation.generate.Prompt that count_tokens reads."""

    tokens: tuple


class FakeBackend:
    """Replies with `pieces`, one per "token"; `after_piece(index)` runs after each one is handed over.

    The prompt length is a word count (plus one per message), so tests can overflow `n_ctx`.
    """

    model_id = "fake-model"
    n_vocab = 1000
    n_ctx = 64
    has_chat = True

    def __init__(self, pieces=("Hello", ",", " wor", "ld", "!"), finish_reason="stop", cached_tokens=0):
        self.pieces = tuple(pieces)
        self.finish_reason = finish_reason
        self.cached_tokens = cached_tokens
        self.calls = []
        self.results = []
        self.after_piece = lambda index: None
        self.error = None

    def prompt_length(self, completion):
        if completion.kind == "chat":
            return sum(len(m["content"].split()) + 1 for m in completion.messages)
        if completion.prompt_tokens is not None:
            return len(completion.prompt_tokens)
        return len(completion.prompt_text.split()) + 1

    def complete(self, completion, on_text, cancelled):
        self.calls.append(completion)
        if self.error is not None:
            raise self.error
        prompt_tokens = self.prompt_length(completion)
        if prompt_tokens >= self.n_ctx:
            param = "messages" if completion.kind == "chat" else "prompt"
            raise ContextTooLong(f"the prompt is {prompt_tokens} tokens; the context holds {self.n_ctx}", param=param)
        text, finish_reason = [], self.finish_reason
        for index, piece in enumerate(self.pieces):
            if cancelled():
                finish_reason = "cancelled"
                break
            if completion.max_tokens is not None and index >= completion.max_tokens:
                finish_reason = "length"
                break
            text.append(piece)
            if on_text is not None:
                on_text(piece)
            self.after_piece(index)
        result = FakeResult("".join(text), finish_reason, prompt_tokens, len(text), self.cached_tokens,
                            tokens=tuple(range(len(text))))
        self.results.append(result)
        return result

    # The worker takes a completion's job from `begin`; this backend answers at once, without steps.
    begin = complete

    def prompt(self, completion):
        """The rendered prompt as Anthropic's count_tokens reads it (`.tokens`): prompt_length ids;
        the call is recorded with the completions."""
        self.calls.append(("prompt", completion))
        if self.error is not None:
            raise self.error
        return FakePrompt(tuple(range(self.prompt_length(completion))))

    def tokenize(self, content, *, add_special, parse_special, with_pieces):
        """Each character is its code point; the call is recorded with the completions."""
        self.calls.append(("tokenize", content))
        if self.error is not None:
            raise self.error
        ids = [ord(c) for c in content]
        return {"tokens": [{"id": i, "piece": chr(i)} for i in ids] if with_pieces else ids}

    def token_pieces(self, tokens):
        return [self.pieces[token].encode("utf-8") for token in tokens]

    def detokenize(self, tokens):
        self.calls.append(("detokenize", tuple(tokens)))
        return {"content": "".join(chr(i) for i in tokens)}


class SynchronousPool:
    """A ThreadPool stand-in: work waits in a FIFO until the test calls run_next() or run_all()."""

    def __init__(self):
        self.pending = []
        self.started = False
        self.stopped = False

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True

    def callInThreadWithCallback(self, on_result, function, *args, **kwargs):
        self.pending.append((on_result, function, args, kwargs))

    def run_next(self):
        on_result, function, args, kwargs = self.pending.pop(0)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            on_result(False, Failure())
        else:
            on_result(True, result)

    def run_all(self):
        while self.pending:
            self.run_next()


class ThreadlessReactor(MemoryReactorClock):
    """MemoryReactorClock whose callFromThread runs at once: the "worker" is the test's own thread."""

    def callFromThread(self, function, *args, **kwargs):
        function(*args, **kwargs)


class APIHarness:
    """The Resource tree over a FakeBackend, driven in memory through StubTreq and our own APISite.

    StubTreq builds a plain Site; we put the server's APISite in its place so the in-memory requests
    meet the same Request class (body limits, Connection: close, log line) as real ones.

    Over a backend with a `scheduler` (the real krafla_twisted.api.backend.Backend), the worker runs
    its forward steps (krafla_twisted/api/worker.py), and the harness watches them: `generations`
    lists what joined the scheduler in arrival order, `steps` counts the steps, and
    `after_step(ended)` runs after each one with the generations that ended in it (the analogue of
    FakeBackend.after_piece: advance the clock, trickle a byte, pause a client). What the hook
    raises is kept in `hook_errors` (the worker would turn it into a failed step); a scheduler that
    is still busy after `max_steps` steps fails its step, so a reply that never ends fails the test
    instead of hanging it.
    """

    def __init__(self, backend=None, *, api_key=None, cors_origins=(), allowed_hosts=(), metrics=None,
                 max_steps=5000):
        self.backend = backend if backend is not None else FakeBackend()
        self.reactor = ThreadlessReactor()
        self.pool = SynchronousPool()
        self.generations = []
        self.steps = 0
        self.max_steps = max_steps
        self.after_step = lambda ended: None
        self.hook_errors = []
        scheduler = getattr(self.backend, "scheduler", None)
        if scheduler is not None:
            self._watch(scheduler)
        self.worker = EngineWorker(self.reactor, self.backend, self.pool)
        self.api = API(self.backend, self.worker, Access(api_key, cors_origins, allowed_hosts), self.reactor)
        self.root = build_root(self.api, metrics)
        self.stub = StubTreq(self.root)
        agent = self.stub._agent
        agent._serverFactory = APISite(self.root, reactor=agent._memoryReactor, metrics=metrics)

    def _watch(self, scheduler):
        step, add = scheduler.step, scheduler.add

        def watched_add(generation):
            self.generations.append(generation)
            add(generation)

        def watched_step():
            if self.steps >= self.max_steps:
                raise RuntimeError(f"the scheduler is still busy after {self.steps} steps")
            self.steps += 1
            ended = step()
            try:
                self.after_step(ended)
            except Exception as e:  # the test's own bug or assertion: reported by run_all's caller
                self.hook_errors.append(e)
            return ended

        scheduler.add, scheduler.step = watched_add, watched_step

    def send(self, method, path, body=None, headers=None, run=True):
        """Start a request; returns its Deferred (the response), with the worker run unless run=False."""
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        all_headers = {"Content-Type": "application/json"}
        all_headers.update(headers or {})
        d = self.stub.request(method, "http://127.0.0.1" + path, data=body, headers=all_headers)
        self.stub.flush()
        if run:
            self.pool.run_all()
            self.stub.flush()
        return d

    def fetch(self, method, path, body=None, headers=None):
        """(response, body bytes) of a request run to its end."""
        response = fired(self.send(method, path, body, headers))
        content = self.stub.content(response)
        self.stub.flush()
        return response, fired(content)


def fired(deferred):
    """The result of a Deferred that must already have fired (its failure is raised)."""
    results = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    result = results[0]
    if isinstance(result, Failure):
        result.raiseException()
    return result


class RawConnection:
    """One server-side HTTP connection over a StringTransport: bytes in, bytes out, no client library.

    For what a client library hides: pause/resume, a client that vanishes, Connection: close,
    timeouts (on the harness's MemoryReactorClock), the head and body limits.
    """

    def __init__(self, harness):

        self.site = APISite(harness.root, reactor=harness.reactor)
        self.protocol = self.site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
        self.protocol.makeConnection(self.transport)

    def send(self, data):
        self.protocol.dataReceived(data)

    def post(self, path, body, headers=b""):
        data = json.dumps(body).encode() if not isinstance(body, bytes) else body
        self.send(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + headers + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
        )

    def output(self):
        return self.transport.value()

    def lose(self):
        self.protocol.connectionLost(Failure(ConnectionLost("the client went away")))


def split_response(raw):
    """(status, headers dict with lower-case names, body bytes) of a raw HTTP/1.1 response, de-chunked."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        body = out
    return status, headers, body


def sse_events(body):
    """The `data:` payloads of an SSE body: JSON objects, and the string "[DONE]"."""
    events = []
    for block in body.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
