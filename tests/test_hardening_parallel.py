"""The HTTP hardening cases while the real Scheduler batches replies, in memory, with --parallel 1 and 8.

tests/test_hardening_http.py pins slowloris, the write deadline, --max-queue and SIGTERM's shutdown
over a scripted backend that answers each request at once. Here the server is the real one: the
real Backend (krafla_twisted/api/backend.py) over a generate.Runtime with 1 or 8 slots, a tiny
random model (tests/support/tiny_models.py) with SmolLM2's own tokenizer and chat template, and
the real EngineWorker stepping the real Scheduler, all in one thread (APIHarness: a synchronous
pool, time on a MemoryReactorClock). APIHarness runs a hook after every forward step, so the clock
moves, bytes trickle in and clients stall or leave while eight streamed replies (text and chat,
greedy and seeded T > 0, some with stop strings) share the steps.

Each case pins what the hostile client gets and, independently of the scheduling, that every
other reply is event for event what it is when the request runs alone on a one-slot server
(the events without their random `id` and the clock's `created`), and that the server answers
/health and a completion afterwards.
"""

import json

import pytest
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.python.failure import Failure

from krafla_twisted.api.backend import Backend
from krafla_twisted.api.site import HEAD_DEADLINE_SECONDS, REQUEST_DEADLINE_SECONDS, WRITE_DEADLINE_SECONDS
from krafla_twisted.chat import templates
from krafla_twisted.engine.model import Model
from krafla_twisted.engine.tokenizer import Tokenizer
from krafla_twisted.generation.generate import Runtime
from tests.support.fake_backend import APIHarness, RawConnection, split_response, sse_events
from tests.support.real_models import real_model
from tests.support.tiny_models import write_tiny_model

CTX = 256
BATCH = 8          # streamed replies that fill the slots of --parallel 8
MAX_TOKENS = 40    # long enough that every deadline below falls while the batch runs
TEXT, CHAT = "/v1/completions", "/v1/chat/completions"


def text_request(prompt, temperature, seed=None, **extra):
    body = {"prompt": prompt, "temperature": temperature, "max_tokens": MAX_TOKENS, "stream": True}
    return TEXT, dict(body, **({"seed": seed} if seed is not None else {}), **extra)


def chat_request(content, temperature, seed=None, **extra):
    body = {"messages": [{"role": "user", "content": content}], "temperature": temperature, "max_tokens": MAX_TOKENS,
            "stream": True}
    return CHAT, dict(body, **({"seed": seed} if seed is not None else {}), **extra)


# The eight streams of every case; the ones marked "stop" get a stop string from their own reply.
BATCH_REQUESTS = [
    (text_request("Once upon a time", 0.0), False),
    (text_request("The capital of France is", 0.9, seed=11), False),
    (chat_request("Tell me a story about a fox.", 0.0), False),
    (chat_request("What is two plus two?", 0.8, seed=5), False),
    (text_request("def fibonacci(n):", 0.7, seed=3), True),
    (chat_request("Write a haiku about rain.", 0.6, seed=23), True),
    (text_request("1, 2, 3, 4,", 0.0), False),
    (chat_request("Name three colours.", 1.0, seed=9), False),
]
# Requests that wait for a slot behind the eight (the 9th and 10th): one text, one chat.
WAITING_REQUESTS = [text_request("Knock knock.", 0.5, seed=21), chat_request("Say hello.", 0.0)]
LATE_REQUEST = text_request("A late request:", 0.4, seed=8)
AFTER_REQUEST = (TEXT, {"prompt": "And afterwards", "temperature": 0.3, "seed": 4, "max_tokens": 12})


class TinyServerParts:
    """The tiny model (SmolLM2's vocabulary size, random weights), SmolLM2's tokenizer and template."""

    def __init__(self, folder):
        pulled = real_model("smollm2-135m")
        self.tokenizer = Tokenizer(str(pulled.mlt))
        write_tiny_model(folder / "tiny.mlb", "qwen2", seed=17, n_vocab=self.tokenizer.n_vocab, max_seq=CTX)
        self.model = Model(str(folder / "tiny.mlb"), threads=1)
        self.template = templates.get_template(pulled.chat)
        self.alone_cache = {}

    def close(self):
        self.model.close()
        self.tokenizer.close()

    def alone(self, request):
        """The normalized reply of `request` run alone on a fresh one-slot server."""
        key = json.dumps(request, sort_keys=True)
        if key not in self.alone_cache:
            served = Served(self, parallel=1)
            try:
                client = served.post(*request)
                served.run()
                self.alone_cache[key] = client.reply()
            finally:
                served.close()
        return self.alone_cache[key]


def normalized(events):
    """SSE events (or a JSON reply) without what differs between two runs of one request: `id`, `created`."""
    return [e if e == "[DONE]" else {k: v for k, v in e.items() if k not in ("id", "created")} for e in events]


class Client:
    """One raw HTTP connection to the served API; `settle` ends it as a real transport does once the
    server closed or aborted it."""

    def __init__(self, served):
        self.connection = RawConnection(served.harness)
        self.closed = False

    def post(self, path, body):
        self.connection.post(path, body)
        return self

    def send(self, data):
        self.connection.send(data)

    def output(self):
        return self.connection.output()

    @property
    def closing(self):
        return self.connection.transport.disconnecting

    @property
    def aborted(self):
        return getattr(self.connection.transport, "disconnected", False)

    def settle(self):
        if self.closing and not self.closed:
            self.closed = True
            reason = ConnectionLost("aborted") if self.aborted else ConnectionDone("closed")
            self.connection.protocol.connectionLost(Failure(reason))

    def leave(self):
        """The client hangs up while its reply is in flight."""
        self.closed = True
        self.connection.lose()

    def status(self):
        return split_response(self.output())[0]

    def events(self):
        """The normalized SSE events received so far."""
        output = self.output()
        return normalized(sse_events(split_response(output)[2])) if output else []

    def reply(self):
        """(status, normalized events) of a stream, (status, normalized JSON body) otherwise."""
        status, headers, body = split_response(self.output())
        if headers.get("content-type", "").startswith("text/event-stream"):
            return status, normalized(sse_events(body))
        return status, normalized([json.loads(body)])[0]


class Served:
    """The real Backend over the tiny model with `parallel` slots, behind APIHarness.

    `begun` records every completion the engine was asked for; `on_step(ended)` runs after each
    forward step, then every connection the server closed is settled."""

    def __init__(self, parts, parallel):
        self.parts = parts
        self.runtime = Runtime(parts.model, parts.tokenizer, parts.template, ctx=CTX, parallel=parallel)
        self.backend = Backend(self.runtime, model_id="tiny")
        self.begun = []
        begin = self.backend.begin

        def recorded_begin(completion, *args, **kwargs):
            self.begun.append(completion)
            return begin(completion, *args, **kwargs)

        self.backend.begin = recorded_begin
        self.harness = APIHarness(self.backend)
        self.scheduler = self.backend.scheduler
        self.clients = []
        self.on_step = lambda ended: None
        self.harness.after_step = self._after_step

    @property
    def parallel(self):
        return self.runtime.parallel

    @property
    def clock(self):
        return self.harness.reactor

    def close(self):
        for slot in self.runtime.slots:  # the model and tokenizer are the module's
            slot.session.close()

    def connect(self):
        client = Client(self)
        self.clients.append(client)
        return client

    def post(self, path, body):
        return self.connect().post(path, body)

    def settle(self):
        for client in self.clients:
            client.settle()

    def _after_step(self, ended):
        self.on_step(ended)
        self.settle()

    def run(self):
        """Run the worker (every job queued, then the scheduler's steps) until it is idle."""
        self.harness.pool.run_all()
        self.harness.stub.flush()
        self.settle()
        if self.harness.hook_errors:
            raise self.harness.hook_errors[0]
        assert not self.scheduler.busy
        assert not any(slot.busy for slot in self.runtime.slots), "a slot was never released"

    def generation(self, index):
        """The generation of the index-th request that reached the scheduler (jobs start in arrival order)."""
        return self.harness.generations[index]

    def assert_serving(self):
        """/health answers, and a completion is what it is alone."""
        self.on_step = lambda ended: None
        response, body = self.harness.fetch("GET", "/health")
        assert (response.code, json.loads(body)) == (200, {"status": "ok"})
        client = self.post(*AFTER_REQUEST)
        self.run()
        status, reply = client.reply()
        want_status, want = self.parts.alone(AFTER_REQUEST)
        assert (status, reply["choices"]) == (want_status, want["choices"]) == (200, want["choices"])


def first_new_occurrence(text, start, width=3):
    """A `width`-character piece of `text` whose first occurrence is at or after `start` (None if none)."""
    for position in range(start, len(text) - width + 1):
        piece = text[position:position + width]
        if piece.strip() and text.find(piece) == position:
            return piece
    return None


def stream_text(events):
    parts = []
    for event in events:
        if event == "[DONE]":
            continue
        choice = event["choices"][0]
        parts.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return "".join(parts)


class Requests:
    """The requests of the cases, with the stop strings of the marked ones taken from their own
    replies (late in the reply, so the stop falls while the batch still runs)."""

    def __init__(self, parts):
        self.batch = []
        for (path, body), with_stop in BATCH_REQUESTS:
            if with_stop:
                status, events = parts.alone((path, body))
                text = stream_text(events)
                stop = first_new_occurrence(text, len(text) * 2 // 3)
                assert status == 200 and stop is not None, text
                body = dict(body, stop=[stop])
                status, events = parts.alone((path, body))
                assert events[-2]["choices"][0]["finish_reason"] == "stop", events[-2:]
                assert stop not in stream_text(events)
            self.batch.append((path, body))
        self.waiting = list(WAITING_REQUESTS)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    parts = TinyServerParts(tmp_path_factory.mktemp("tiny-server"))
    yield parts
    parts.close()


@pytest.fixture(scope="module")
def requests(parts):
    made = Requests(parts)
    for request in made.batch + made.waiting:  # every stream is long enough to outlast the deadlines
        status, events = parts.alone(request)
        assert status == 200 and len(events) > 10, (request, events)
    return made


@pytest.fixture(params=[1, 8], ids=lambda n: f"parallel{n}")
def served(parts, request):
    served = Served(parts, request.param)
    yield served
    served.close()


def assert_alone(parts, requests, clients):
    """Each client's reply is, event for event, the one its request gets alone."""
    for request, client in zip(requests, clients):
        assert client.reply() == parts.alone(request), request


class SlowlorisTests:
    """Receive deadlines while the scheduler batches replies: the slow client's clock runs from its
    connection, whatever the engine is doing, and it never reaches the engine."""

    SECONDS_PER_STEP = 5

    def test_head_and_body_trickling_get_408_at_their_deadlines(self, parts, requests, served):
        """A head trickling a byte per forward step (5 s of clock each) gets 408 request_timeout at
        exactly HEAD_DEADLINE_SECONDS, a body trickling likewise at REQUEST_DEADLINE_SECONDS, while
        every slot holds a reply; neither reaches the engine; the eight streams are their alone bytes."""
        streams = [served.post(*request) for request in requests.batch]
        slow_head, slow_body = served.connect(), served.connect()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400
        slow_body.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 400\r\n\r\n")
        cut_off, sent = {}, []

        def trickle(ended):
            sent.append(head[len(sent):len(sent) + 1])
            for name, client in (("head", slow_head), ("body", slow_body)):
                if name not in cut_off:
                    client.send(sent[-1] if name == "head" else b" ")
            served.clock.advance(self.SECONDS_PER_STEP)
            for name, client in (("head", slow_head), ("body", slow_body)):
                if name not in cut_off and client.closing:
                    cut_off[name] = (served.clock.seconds(), served.scheduler.slots_busy)

        served.on_step = trickle
        served.run()
        # Cut off at the deadline, with every slot busy (the batch was running).
        assert cut_off == {"head": (HEAD_DEADLINE_SECONDS, served.parallel),
                           "body": (REQUEST_DEADLINE_SECONDS, served.parallel)}
        for client in (slow_head, slow_body):
            status, headers, body = split_response(client.output())
            assert status == 408
            assert json.loads(body)["error"]["code"] == "request_timeout"
            assert headers["connection"] == "close"
        assert len(served.begun) == BATCH, "a slow request reached the engine"
        assert_alone(parts, requests.batch, streams)
        served.assert_serving()


class StalledStreamTests:
    """A stream whose client stops reading, or leaves, mid-batch: its generation ends "cancelled" at
    the next step and its slot goes at once to the request waiting first."""

    VICTIM = 1  # a long seeded text stream (no stop string)
    SECONDS_PER_STEP = 10

    @pytest.mark.parametrize("how", ["paused", "gone"])
    def test_slot_freed_for_the_next_request(self, parts, requests, served, how):
        """Paused (the transport's buffer full, pauseProducing) after two pieces: aborted at exactly
        WRITE_DEADLINE_SECONDS, having received only a prefix of its alone stream; or gone (the client
        disconnects) after two pieces. Either way its generation ends "cancelled" in the next step,
        before its reply's end, and in the step after that the first waiting request (with 8 slots,
        the 9th) takes that very slot; every other stream, that one included, is its alone bytes."""
        everyone = requests.batch + requests.waiting
        clients = [served.post(*request) for request in everyone]
        victim = clients[self.VICTIM]
        seen = {}

        def stall(ended):
            step = served.harness.steps
            served.clock.advance(self.SECONDS_PER_STEP)
            victim_generation = served.generation(self.VICTIM)
            if how == "paused" and "aborted" not in seen and victim.aborted:
                seen["aborted"] = served.clock.seconds()
                victim.settle()  # the transport reports the abort: the reply's client is gone
            if "stalled" not in seen and len(victim.events()) >= 2:
                seen["stalled"] = (step, served.clock.seconds())
                if how == "paused":
                    victim.connection.protocol.pauseProducing()  # what a transport does when its buffer is full
                else:
                    victim.leave()
            if victim.closed and "cancelled" not in seen:
                seen["cancelled"] = step
            if "cancelled" in seen and step == seen["cancelled"] + 1:
                seen["released"] = victim_generation in ended
                seen["successor"] = served.scheduler.waiting[0] if served.scheduler.waiting else None
            if "successor" in seen and step == seen["cancelled"] + 2:
                seen["successor slot"] = seen["successor"] is not None and seen["successor"].slot

        served.on_step = stall
        served.run()
        victim_generation = served.generation(self.VICTIM)
        stalled_at = seen["stalled"][1]
        if how == "paused":
            assert seen["aborted"] == stalled_at + WRITE_DEADLINE_SECONDS
        assert victim_generation.result.finish_reason == "cancelled"
        assert victim_generation.result.completion_tokens < MAX_TOKENS
        assert seen["released"], "the cancelled generation did not end in the step after its client left"
        assert seen["successor"] is not None, "no request waited for the slot"
        if served.parallel == BATCH:
            assert seen["successor"] is served.generation(BATCH)  # the 9th request
        assert seen["successor slot"] is victim_generation.slot, "the waiting request did not take the freed slot"
        # What the victim got is the start of its alone stream, without the end.
        received = victim.events()
        status, alone = parts.alone(everyone[self.VICTIM])
        assert 2 <= len(received) < len(alone) - 1 and received == alone[:len(received)]
        others = [i for i in range(len(everyone)) if i != self.VICTIM]
        assert_alone(parts, [everyone[i] for i in others], [clients[i] for i in others])
        served.assert_serving()

    def test_resumed_in_time_is_whole(self, parts, requests, served):
        """Paused after two pieces while the batch runs on, and reading again 10 s before the write
        deadline: not cut off; the events held meanwhile arrive in order, so that stream, like every
        other, is its alone bytes."""
        clients = [served.post(*request) for request in requests.batch]
        victim = clients[self.VICTIM]
        paused = {}

        def pause_then_resume(ended):
            served.clock.advance(self.SECONDS_PER_STEP)
            if not paused and len(victim.events()) >= 2:
                paused["at"] = served.clock.seconds()
                paused["received"] = len(victim.events())
                victim.connection.protocol.pauseProducing()
            elif paused and "resumed" not in paused and \
                    served.clock.seconds() == paused["at"] + WRITE_DEADLINE_SECONDS - self.SECONDS_PER_STEP:
                paused["held"] = len(victim.events()) == paused["received"]
                paused["resumed"] = not served.generation(self.VICTIM).done
                victim.connection.protocol.resumeProducing()

        served.on_step = pause_then_resume
        served.run()
        assert paused["held"], "events were written to a paused client"
        assert paused["resumed"], "the victim's reply ended before its client read again"
        assert not victim.aborted
        assert_alone(parts, requests.batch, clients)
        served.assert_serving()


class MaxQueueTests:
    """--max-queue with every slot busy: the slots plus max_queue requests are taken, the next is 503
    with Retry-After before any work, and a queued client that leaves frees its place."""

    def test_503_beyond_the_queue_and_a_place_freed(self, parts, requests, served):
        """With slots + max_queue = 10 requests taken (8 streams, 2 more waiting), one more gets 503
        server_overloaded with Retry-After: 1 while the batch runs; after a waiting client leaves, a
        new request is taken (and is its alone bytes), and the one after it is 503 again. The waiting
        client's generation never takes a slot; the 503s never reach the engine."""
        served.harness.api.max_queue = BATCH + len(requests.waiting) - served.parallel
        everyone = requests.batch + requests.waiting
        clients = [served.post(*request) for request in everyone]
        leaving = clients[-1]
        during = {}

        def overload(ended):
            if served.harness.steps != 3:
                return
            during["slots busy"] = served.scheduler.slots_busy
            during["refused"] = served.post(*LATE_REQUEST)
            leaving.leave()
            during["late"] = served.post(*LATE_REQUEST)
            during["refused again"] = served.post(*LATE_REQUEST)

        served.on_step = overload
        served.run()
        assert during["slots busy"] == served.parallel
        for name in ("refused", "refused again"):
            status, headers, body = split_response(during[name].output())
            assert status == 503, name
            assert headers["retry-after"] == "1"
            error = json.loads(body)["error"]
            assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
        left = served.generation(len(everyone) - 1)
        assert left.slot is None and left.skipped and left.result.finish_reason == "cancelled"
        assert leaving.output() == b""
        assert len(served.begun) == len(everyone) + 1, "a refused request reached the engine"
        assert_alone(parts, everyone[:-1] + [LATE_REQUEST], clients[:-1] + [during["late"]])
        served.assert_serving()


class ShutdownTests:
    """SIGTERM's path (API.shutdown, then the worker's stop, as KraflaService.stopService does)
    while every slot streams a reply."""

    def test_streams_end_with_an_error_event_and_waiting_requests_get_503(self, parts, requests, served):
        """Once every busy slot has streamed text: each started stream ends with the events it got
        so far (the start of its alone stream), an error event server_shutting_down and [DONE];
        every request that had nothing yet (a waiting stream, the waiting plain request) gets 503
        server_shutting_down. The scheduler runs one more step, in which every generation ends
        "cancelled" and every slot is freed; /health still answers and a new completion gets 503."""
        plain_text, plain_body = requests.waiting[0]
        everyone = requests.batch + [(plain_text, dict(plain_body, stream=False)), requests.waiting[1]]
        clients = [served.post(*request) for request in everyone]
        at_shutdown = {}

        def stop(ended):
            active = served.scheduler.active
            if at_shutdown or len(active) < served.parallel or not all(g.pieces for g in active):
                return
            at_shutdown["step"] = served.harness.steps
            at_shutdown["started"] = [bool(client.output()) for client in clients]
            served.harness.api.shutdown()
            served.harness.worker.stop()

        served.on_step = stop
        served.run()
        assert at_shutdown, "the slots never all streamed at once"
        assert served.harness.steps == at_shutdown["step"] + 1
        assert sum(at_shutdown["started"]) >= served.parallel
        for index, (request, client) in enumerate(zip(everyone, clients)):
            generation = served.generation(index)
            assert generation.result.finish_reason == "cancelled", index
            if at_shutdown["started"][index]:
                events = client.events()
                status, alone = parts.alone(request)
                assert events[-2]["error"]["code"] == "server_shutting_down"
                assert events[-1] == "[DONE]"
                assert events[:-2] == alone[:len(events) - 2] and len(events) - 2 < len(alone) - 1
            else:
                status, headers, body = split_response(client.output())
                assert (status, headers["content-type"]) == (503, "application/json"), index
                assert json.loads(body)["error"]["code"] == "server_shutting_down"
        response, body = served.harness.fetch("GET", "/health")
        assert response.code == 200
        response, body = served.harness.fetch("POST", *AFTER_REQUEST)
        assert (response.code, json.loads(body)["error"]["code"]) == (503, "server_shutting_down")
