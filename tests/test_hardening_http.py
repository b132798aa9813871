"""The HTTP layer under hostile clients, in memory: bytes on a StringTransport, time on a MemoryReactorClock.

Pins what Twisted does not do by itself and what we added: the absolute deadlines for receiving a
request (a byte every few seconds does not hold a connection), the write deadline for a client that
stops reading, refused bodies read through only up to a bound, request framing that could smuggle a
second request (duplicate or conflicting Content-Length, Content-Length with Transfer-Encoding),
pipelining, the API key on every path form that routes, HEAD and OPTIONS on every route, CORS,
--max-queue, SIGTERM's shutdown of replies in flight, and engine errors.

The backend here is scripted (tests/support/fake_backend.py) and answers each request at once.
tests/test_hardening_parallel.py runs the deadlines, --max-queue and the shutdown again over the
real backend, whose Scheduler batches eight streamed replies (--parallel 1 and 8).
"""

import json
import unittest

from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from krafla_twisted.api.site import APISite
from krafla_twisted.engine import clib
from krafla_twisted.api.site import (
    DISCARD_LIMIT_BYTES, HEAD_DEADLINE_SECONDS, MAX_BODY_BYTES, REQUEST_DEADLINE_SECONDS, WRITE_DEADLINE_SECONDS,
)
from tests.support.fake_backend import APIHarness, RawConnection, fired, split_response, sse_events

KEY = "s3cret-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def aborted(connection):
    """The server called abortConnection (StringTransport sets `disconnected` only then)."""
    return getattr(connection.transport, "disconnected", False)


def error_of(test, raw_body):
    payload = json.loads(raw_body)
    test.assertEqual(set(payload), {"error"})
    test.assertEqual(set(payload["error"]), {"message", "type", "param", "code"})
    return payload["error"]


class ReceiveDeadlineTests(unittest.TestCase):
    """Slowloris: the head within 60 s of connecting, the whole request within 120 s, however it trickles."""

    def test_head_one_byte_every_five_seconds(self):
        """Each byte resets the idle timer, yet at 60 s the connection gets 408 with the error body and closes."""
        harness = APIHarness()
        connection = RawConnection(harness)
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        for index in range(11):
            connection.send(head[index:index + 1])
            harness.reactor.advance(5)
        self.assertFalse(connection.transport.disconnecting, "closed before the head deadline")
        harness.reactor.advance(HEAD_DEADLINE_SECONDS - 55)
        self.assertTrue(connection.transport.disconnecting)
        status, headers, body = split_response(connection.output())
        self.assertEqual(status, 408)
        self.assertEqual(error_of(self, body)["code"], "request_timeout")
        connection.send(b"\r\n\r\n")  # too late: nothing more is read
        self.assertEqual(connection.output().count(b"HTTP/1.1 "), 1)

    def test_silent_connection_closed_once(self):
        """Nothing sent: the idle timer and the head deadline both fall at 60 s; the connection closes once,
        with at most one answer, and the only timers left are the ones that abort a close that hangs."""
        harness = APIHarness()
        connection = RawConnection(harness)
        harness.reactor.advance(HEAD_DEADLINE_SECONDS)
        self.assertTrue(connection.transport.disconnecting)
        self.assertLessEqual(connection.output().count(b"HTTP/1.1 "), 1)
        pending = [call.func.__name__ for call in harness.reactor.getDelayedCalls() if call.active()]
        self.assertTrue(set(pending) <= {"forceAbortClient", "_not_reading"}, pending)
        connection.lose()
        self.assertEqual([call for call in harness.reactor.getDelayedCalls() if call.active()], [])

    def test_body_one_byte_every_five_seconds(self):
        """A complete head and a body trickling in: cut off at 120 s, the engine never called."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        for _ in range(23):
            connection.send(b" ")
            harness.reactor.advance(5)
        self.assertFalse(connection.transport.disconnecting)
        harness.reactor.advance(REQUEST_DEADLINE_SECONDS - 115)
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual(split_response(connection.output())[0], 408)
        self.assertEqual(harness.backend.calls, [])

    def test_whole_request_in_time_is_not_cut_off(self):
        """A request that arrives whole at 119 s is answered, however long the engine then takes."""
        harness = APIHarness()
        connection = RawConnection(harness)
        body = json.dumps({"prompt": "x"}).encode()
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        for index, byte in enumerate(body):
            connection.send(bytes([byte]))
            harness.reactor.advance(119 / len(body))
        harness.reactor.advance(1000)
        self.assertFalse(connection.transport.disconnecting)
        harness.pool.run_all()
        self.assertEqual(split_response(connection.output())[0], 200)


class WriteDeadlineTests(unittest.TestCase):
    """A client that stops reading is cut off after 60 s, and its generation stops."""

    def test_paused_stream_aborted_and_generation_cancelled(self):
        """The transport's buffer stays full for 60 s: the connection is aborted and the job sees cancelled."""
        harness = APIHarness()
        connection = RawConnection(harness)

        def stall(index):
            if index == 0:
                connection.protocol.pauseProducing()  # what a transport does when its buffer is full
            if index == 2:
                harness.reactor.advance(WRITE_DEADLINE_SECONDS)
                # A real transport calls connectionLost after the abort.
                if aborted(connection):
                    connection.lose()

        harness.backend.after_piece = stall
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.reactor.advance(WRITE_DEADLINE_SECONDS - 1)
        harness.pool.run_all()
        self.assertTrue(aborted(connection))
        self.assertEqual(harness.backend.results[-1].finish_reason, "cancelled")
        self.assertEqual(harness.backend.results[-1].text, "Hello, wor")

    def test_resumed_in_time_is_not_cut_off(self):
        """Paused for 59 s, then the client reads again: the stream finishes whole."""
        harness = APIHarness()
        connection = RawConnection(harness)

        def stall(index):
            if index == 0:
                connection.protocol.pauseProducing()
                harness.reactor.advance(WRITE_DEADLINE_SECONDS - 1)
                connection.protocol.resumeProducing()
                harness.reactor.advance(WRITE_DEADLINE_SECONDS - 1)

        harness.backend.after_piece = stall
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.pool.run_all()
        self.assertFalse(aborted(connection))
        self.assertEqual(sse_events(split_response(connection.output())[2])[-1], "[DONE]")

    def test_finished_reply_never_read(self):
        """A whole reply written, the close waiting on a client that reads nothing: aborted at 60 s."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x"})
        harness.pool.run_all()
        self.assertTrue(connection.transport.disconnecting)
        harness.reactor.advance(WRITE_DEADLINE_SECONDS - 1)
        self.assertFalse(aborted(connection))
        harness.reactor.advance(1)
        self.assertTrue(aborted(connection))

    def test_closed_connection_leaves_no_timer(self):
        """Once the connection is gone, no deadline is left on the clock."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.pool.run_all()
        connection.lose()
        self.assertEqual([c for c in harness.reactor.getDelayedCalls() if c.active()], [])


class BodyFramingTests(unittest.TestCase):
    """Request framing: what could smuggle a second request is a 400 and a close; refused bodies are bounded."""

    def assert_refused(self, raw, status):
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(raw)
        harness.pool.run_all()
        self.assertEqual(split_response(connection.output())[0], status, raw[:120])
        self.assertTrue(connection.transport.disconnecting)
        self.assertEqual(harness.backend.calls, [], raw[:120])
        return connection

    def test_ambiguous_lengths_refused(self):
        """Two Content-Lengths (equal or not), a list, a sign, Content-Length with Transfer-Encoding,
        an encoding other than chunked: 400 with the error body and the connection closed, nothing reaches
        the engine."""
        body = b'{"prompt":"x"}'
        start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        for headers in (b"Content-Length: 14\r\nContent-Length: 14\r\n", b"Content-Length: 14\r\nContent-Length: 15\r\n",
                        b"Content-Length: 14, 14\r\n", b"Content-Length: +14\r\n", b"Content-Length: -1\r\n",
                        b"Content-Length: 0x0e\r\n", b"Content-Length: 14\r\nTransfer-Encoding: chunked\r\n",
                        b"Transfer-Encoding: chunked\r\nContent-Length: 14\r\n", b"Transfer-Encoding: gzip, chunked\r\n",
                        b"Transfer-Encoding: identity\r\n"):
            connection = self.assert_refused(start + headers + b"\r\n" + body, 400)
            self.assertEqual(error_of(self, split_response(connection.output())[2])["code"], "invalid_http_request")

    def test_chunked_refused_after_its_end_or_at_the_bound(self):
        """A short chunked body: 411 once it ends. An endless one: 411 after 16 MiB read, then nothing more is read."""
        self.assert_refused(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"e\r\n{\"prompt\":\"x\"}\r\n0\r\n\r\n", 411)
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"100000\r\n" + b"a" * 0x100000 + b"\r\n"
        sent = 0
        while not connection.transport.disconnecting and sent < 4 * DISCARD_LIMIT_BYTES:
            connection.send(chunk)
            sent += len(chunk)
        self.assertTrue(connection.transport.disconnecting)
        self.assertLessEqual(sent, DISCARD_LIMIT_BYTES + 2 * len(chunk))
        status, headers, body = split_response(connection.output())
        self.assertEqual(status, 411)
        self.assertEqual(headers["connection"], "close")
        error_of(self, body)

    def test_huge_content_length_answered_before_the_body(self):
        """Content-Length of 100 GiB: 413 at once, without waiting for a single body byte."""
        connection = self.assert_refused(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (100 << 30), 413)
        self.assertEqual(error_of(self, split_response(connection.output())[2])["code"], "request_too_large")

    def test_over_limit_read_through_then_answered(self):
        """8 MiB + 1 by Content-Length: the body is read (so the client sees the reply), then 413."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        connection.send(b"a" * MAX_BODY_BYTES)
        self.assertEqual(connection.output(), b"")
        connection.send(b"a")
        self.assertEqual(split_response(connection.output())[0], 413)

    def test_expect_continue(self):
        """Expect: 100-continue on a body over the limit gets 413 at once and no invitation to send it;
        on an acceptable body, 100 Continue and then the reply."""
        connection = self.assert_refused(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
            % (MAX_BODY_BYTES + 1), 413)
        self.assertNotIn(b"100 Continue", connection.output())
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 14\r\n\r\n")
        self.assertTrue(connection.output().startswith(b"HTTP/1.1 100 Continue\r\n\r\n"))
        connection.send(b'{"prompt":"x"}')
        harness.pool.run_all()
        self.assertIn(b"HTTP/1.1 200 OK", connection.output())

    def test_pipelined_request_never_runs(self):
        """A second request behind the first on one connection (a smuggling attempt) never reaches the engine."""
        harness = APIHarness()
        connection = RawConnection(harness)
        body = json.dumps({"prompt": "first"}).encode()
        second = json.dumps({"prompt": "second"}).encode()
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body, len(second), second))
        harness.pool.run_all()
        self.assertEqual([c.prompt_text for c in harness.backend.calls], ["first"])
        self.assertEqual(connection.output().count(b"HTTP/1.1 "), 1)


# Every route, and how a client (or an attacker) might spell it.
ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/fake-model"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions")]


def path_forms(path):
    """Spellings of `path` a proxy or a router might treat as the same (vLLM GHSA-94f4-hr76-p5j6 and kin)."""
    bare = path[len("/v1"):]
    segments = path.strip("/").split("/")
    forms = {path, bare, path + "/", "/" + path, "//" + path.lstrip("/"), path.replace("/v1/", "/v1//"),
             "/./" + path.lstrip("/"), path.replace("/v1/", "/v1/./"), path.replace("/v1/", "/v1/x/../"),
             "/health/.." + path, "/v1/health/.." + bare, path + "?x=1", path + "#f", path + ";x",
             path.upper(), path.replace("v1", "%76%31"), "/" + "/".join(s[0] + "%" + format(ord(s[1]), "02x") + s[2:]
                                                                      if len(s) > 2 else s for s in segments),
             path.replace("/", "%2f").replace("%2f", "/", 1), path.replace("/", "\\"), "http://x" + path}
    return sorted(forms)


class AuthPathTests(unittest.TestCase):
    """The API key covers every path form that reaches an endpoint; only /health is open."""

    def setUp(self):
        self.harness = APIHarness(api_key=KEY)

    def status(self, method, path, key=None):
        connection = RawConnection(self.harness)
        body = json.dumps(CHAT if "chat" in path else {"prompt": "x"}).encode() if method == "POST" else b""
        auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key else b""
        connection.send(method.encode() + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth
                        + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.harness.pool.run_all()
        return split_response(connection.output())

    def test_no_form_of_a_route_answers_without_the_key(self):
        """Each spelling that is served with the key (200) is 401 without it; the others are 401 or 404, never 200."""
        served = 0
        for method, path in ROUTES:
            for form in path_forms(path):
                status, _, body = self.status(method, form)
                with_key = self.status(method, form, KEY)[0]
                self.assertIn(status, (400, 401, 404), (method, form, body))
                if with_key == 200:
                    served += 1
                    self.assertEqual(status, 401, (method, form))
        self.assertGreaterEqual(served, 3 * len(ROUTES), "most plain spellings must be served")

    def test_health_open_and_only_health(self):
        """/health in its forms answers without the key; paths under it do not reach other endpoints."""
        for form in ("/health", "/v1/health", "/health/", "/v1/health/", "/health?x=1"):
            status, _, body = self.status("GET", form)
            self.assertEqual((status, json.loads(body)), (200, {"status": "ok"}), form)
        for form in ("/health/../v1/models", "/health/x", "/v1/health/../completions"):
            status, _, body = self.status("GET", form)
            self.assertNotEqual(status, 200, form)
            self.assertNotIn(b"fake-model", body)

    def test_bearer_forms(self):
        """The scheme is case-insensitive; an empty token, another scheme, extra words or two headers are 401."""
        def with_header(*values):
            connection = RawConnection(self.harness)
            lines = b"".join(b"Authorization: " + v + b"\r\n" for v in values)
            connection.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
            return split_response(connection.output())[0]

        key = KEY.encode()
        for good in (b"Bearer " + key, b"bearer " + key, b"BEARER " + key, b"Bearer  " + key, b"Bearer " + key + b" "):
            self.assertEqual(with_header(good), 200, good)
        for bad in (b"", b"Bearer", b"Bearer ", b"bearer", b"Basic " + key, b"Bearer" + key, b"Bearer " + key + b" x",
                    b"Bearer " + key[:-1], b"Bearer " + key + b"x", b"Bearer " + key.upper(), key, b"Token " + key):
            self.assertEqual(with_header(bad), 401, bad)
        self.assertEqual(with_header(b"Bearer " + key, b"Bearer wrong"), 401)
        self.assertEqual(with_header(b"Bearer wrong", b"Bearer " + key), 401)

    def test_head_and_options_on_every_route(self):
        """HEAD: like GET where GET is allowed (no body), 405 elsewhere, 401 without the key.
        OPTIONS: 204 with Allow everywhere (a preflight carries no key), and no CORS grant without --cors."""
        for method, path in ROUTES + [("GET", "/health"), ("GET", "/v1/nope")]:
            status, headers, body = self.status("HEAD", path, KEY)
            expected = 404 if "nope" in path else 200 if method == "GET" else 405
            self.assertEqual(status, expected, path)
            self.assertEqual(body, b"", path)
            if "health" not in path:
                self.assertEqual(self.status("HEAD", path)[0], 401, path)
            status, headers, body = self.status("OPTIONS", path)
            self.assertEqual(status, 204, path)
            self.assertIn("POST", headers["allow"])
            self.assertNotIn("access-control-allow-origin", headers)


class CORSTests(unittest.TestCase):
    """CORS is off unless asked, and never reflects an origin that was not allowed."""

    ORIGINS = ("http://app.example", "http://app.example.evil", "http://evil.app.example", "null", "HTTP://APP.EXAMPLE",
               "http://app.example/", "http://app.example:80", "https://app.example", "")

    def grant(self, harness, origin, method="GET"):
        connection = RawConnection(harness)
        connection.send(method.encode() + b" /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: " + origin.encode()
                        + b"\r\nAccess-Control-Request-Method: POST\r\n\r\n")
        return split_response(connection.output())[1].get("access-control-allow-origin")

    def test_off_by_default(self):
        """Without --cors no origin gets a grant, for requests or preflights."""
        harness = APIHarness()
        for origin in self.ORIGINS:
            self.assertIsNone(self.grant(harness, origin))
            self.assertIsNone(self.grant(harness, origin, "OPTIONS"))

    def test_only_the_allowed_origin(self):
        """--cors http://app.example grants exactly that origin, byte for byte; look-alikes get nothing."""
        harness = APIHarness(cors_origins=("http://app.example",))
        for origin in self.ORIGINS:
            expected = "http://app.example" if origin == "http://app.example" else None
            self.assertEqual(self.grant(harness, origin), expected, origin)
            self.assertEqual(self.grant(harness, origin, "OPTIONS"), expected, origin)

    def test_star_never_reflects(self):
        """--cors '*' answers '*', never the caller's origin (which would let credentials through)."""
        harness = APIHarness(cors_origins=("*",))
        for origin in self.ORIGINS[:-1]:
            self.assertEqual(self.grant(harness, origin), "*", origin)


class MaxQueueTests(unittest.TestCase):
    """--max-queue: beyond it, 503 with Retry-After, before any work."""

    def test_503_beyond_the_queue(self):
        """max_queue 1: one running and one waiting are taken; the third is 503 with Retry-After: 1."""
        harness = APIHarness()
        harness.api.max_queue = 1
        first = harness.send("POST", "/v1/completions", {"prompt": "one"}, run=False)
        second = harness.send("POST", "/v1/completions", {"prompt": "two"}, run=False)
        response, body = harness.fetch("POST", "/v1/completions", {"prompt": "three"})
        self.assertEqual(response.code, 503)
        self.assertEqual(response.headers.getRawHeaders("retry-after"), ["1"])
        error = error_of(self, body)
        self.assertEqual((error["type"], error["code"]), ("server_error", "server_overloaded"))
        self.assertEqual([c.prompt_text for c in harness.backend.calls], ["one", "two"])
        self.assertEqual((fired(first).code, fired(second).code), (200, 200))
        self.assertEqual(harness.fetch("POST", "/v1/completions", {"prompt": "four"})[0].code, 200)

    def test_tokenize_waits_in_the_queue(self):
        """/tokenize and /detokenize are jobs on the engine worker: they wait behind a completion, count
        against --max-queue, and run in order."""
        harness = APIHarness()
        harness.api.max_queue = 1
        first = harness.send("POST", "/v1/completions", {"prompt": "one"}, run=False)
        tokenize = harness.send("POST", "/tokenize", {"content": "hi"}, run=False)
        self.assertEqual(len(harness.pool.pending), 2)
        self.assertEqual(harness.backend.calls, [])
        response, body = harness.fetch("POST", "/detokenize", {"tokens": [104, 105]})
        self.assertEqual((response.code, error_of(self, body)["code"]), (503, "server_overloaded"))
        harness.pool.run_all()
        harness.stub.flush()
        self.assertEqual(fired(first).code, 200)
        self.assertEqual(json.loads(fired(harness.stub.content(fired(tokenize)))), {"tokens": [104, 105], "count": 2, "max_model_len": 64})
        self.assertEqual([call if isinstance(call, tuple) else call.prompt_text for call in harness.backend.calls],
                         ["one", ("tokenize", "hi")])

    def test_invalid_request_is_400_even_when_full(self):
        """A full queue does not hide a bad request's 400."""
        harness = APIHarness()
        harness.api.max_queue = 0
        harness.send("POST", "/v1/completions", {"prompt": "one"}, run=False)
        self.assertEqual(harness.fetch("POST", "/v1/completions", {"prompt": -1})[0].code, 400)

    def test_client_that_left_frees_its_place(self):
        """A queued client that disconnects no longer counts against the queue."""
        harness = APIHarness()
        harness.api.max_queue = 1
        harness.send("POST", "/v1/completions", {"prompt": "one"}, run=False)
        gone = RawConnection(harness)
        gone.post("/v1/completions", {"prompt": "two"})
        gone.lose()
        third = harness.send("POST", "/v1/completions", {"prompt": "three"}, run=False)
        harness.pool.run_all()
        harness.stub.flush()
        self.assertEqual(fired(third).code, 200)
        self.assertEqual([c.prompt_text for c in harness.backend.calls], ["one", "three"])


class ShutdownTests(unittest.TestCase):
    """What SIGTERM does to replies in flight (KraflaService.stopService calls API.shutdown)."""

    def test_streams_end_with_an_error_event_and_waiting_requests_get_503(self):
        """A started stream gets an error event then [DONE]; a queued plain and a queued stream get 503;
        the worker's late results write nothing more; new requests get 503."""
        harness = APIHarness()
        streaming = RawConnection(harness)

        def stop_mid_reply(index):
            if index == 1:
                harness.api.shutdown()

        harness.backend.after_piece = stop_mid_reply
        streaming.post("/v1/completions", {"prompt": "x", "stream": True})
        queued = RawConnection(harness)
        queued.post("/v1/completions", {"prompt": "y"})
        queued_stream = RawConnection(harness)
        queued_stream.post("/v1/chat/completions", dict(CHAT, stream=True))
        harness.pool.run_all()
        events = sse_events(split_response(streaming.output())[2])
        self.assertEqual("".join(e["choices"][0]["text"] for e in events[:-2]), "Hello,")
        self.assertEqual(events[-2]["error"]["code"], "server_shutting_down")
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(harness.backend.results[0].finish_reason, "cancelled")
        for connection in (queued, queued_stream):
            status, headers, body = split_response(connection.output())
            self.assertEqual(status, 503)
            self.assertEqual(headers["content-type"], "application/json")
            self.assertEqual(error_of(self, body)["code"], "server_shutting_down")
        self.assertEqual(len(harness.backend.calls), 1, "queued jobs ran after shutdown")

    def test_new_requests_after_shutdown_get_503_before_any_work(self):
        """Once API.shutdown ran, a new completion, stream, /tokenize or /detokenize is answered 503
        server_shutting_down by the shutdown check itself: no job is queued, the backend is never called."""
        harness = APIHarness()
        harness.api.shutdown()
        for path, body in (("/v1/completions", {"prompt": "z"}), ("/v1/chat/completions", dict(CHAT, stream=True)),
                           ("/tokenize", {"content": "z"}), ("/detokenize", {"tokens": [1]})):
            response = harness.send("POST", path, body, run=False)
            self.assertEqual(harness.pool.pending, [], path)
            response = fired(response)
            self.assertEqual(response.code, 503, path)
            self.assertEqual(error_of(self, fired(harness.stub.content(response)))["code"], "server_shutting_down")
        self.assertEqual(harness.backend.calls, [])

    def test_queued_tokenize_gets_503_at_shutdown(self):
        """/tokenize waiting behind a completion when the server stops gets 503; the tokenizer is not used."""
        harness = APIHarness()
        harness.send("POST", "/v1/completions", {"prompt": "x"}, run=False)
        queued = RawConnection(harness)
        queued.post("/tokenize", {"content": "abc"})
        harness.api.shutdown()
        harness.worker.stop()
        harness.pool.run_all()
        status, _, body = split_response(queued.output())
        self.assertEqual((status, error_of(self, body)["code"]), (503, "server_shutting_down"))
        self.assertNotIn(("tokenize", "abc"), harness.backend.calls)

    def test_close_connections_waits_for_replies(self):
        """The Site's shutdown closes idle connections at once and fires when the last connection is gone."""
        harness = APIHarness()
        site = APISite(harness.root, reactor=harness.reactor)
        idle = site.buildProtocol(None)
        idle_transport = StringTransport()
        idle.makeConnection(idle_transport)
        busy = site.buildProtocol(None)
        busy.makeConnection(StringTransport())
        busy.dataReceived(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\n\r\n{\"prompt\":\"x\"}")
        done = []
        site.close_connections(5).addCallback(done.append)
        self.assertTrue(idle_transport.disconnecting)
        idle.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(done, [])
        busy.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(done, [None])

    def test_close_connections_gives_up(self):
        """A connection still open after the grace period is aborted and the shutdown goes on."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x"})
        done = []
        connection.site.close_connections(5).addCallback(done.append)
        harness.reactor.advance(5)
        self.assertTrue(aborted(connection))
        self.assertEqual(done, [None])


class EngineErrorTests(unittest.TestCase):
    """An engine error is a 500 with the error body, and the next request is served."""

    def test_engine_error_then_served(self):
        """clib.KraflaError from the engine: 500 server_error with the engine's message; then 200."""
        harness = APIHarness()
        harness.backend.error = clib.KraflaError("kr_session_eval: out of memory", status=3)
        response, body = harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        self.assertEqual(response.code, 500)
        error = error_of(self, body)
        self.assertEqual(error["type"], "server_error")
        self.assertIn("out of memory", error["message"])
        harness.backend.error = None
        response, body = harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(body)["choices"][0]["text"], "Hello, world!")

    def test_engine_error_mid_stream_then_served(self):
        """Mid-stream the error is an event before [DONE]; the next streamed request is whole."""
        harness = APIHarness()

        def explode(index):
            if index == 2:
                raise clib.KraflaError("kr_session_eval: engine fault")

        harness.backend.after_piece = explode
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.pool.run_all()
        events = sse_events(split_response(connection.output())[2])
        self.assertIn("engine fault", events[-2]["error"]["message"])
        self.assertEqual(events[-1], "[DONE]")
        harness.backend.after_piece = lambda index: None
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.pool.run_all()
        events = sse_events(split_response(connection.output())[2])
        self.assertEqual("".join(e["choices"][0]["text"] for e in events[:-1]), "Hello, world!")


class DNSRebindingTests(unittest.TestCase):
    """Without an API key, requests addressed to a DNS name a web page could re-point at 127.0.0.1 are refused."""

    def status(self, harness, host, method=b"GET", path=b"/v1/models", key=None):
        connection = RawConnection(harness)
        head = method + b" " + path + b" HTTP/1.1\r\n"
        if host is not None:
            head += b"Host: " + host + b"\r\n"
        if key:
            head += b"Authorization: Bearer " + key.encode() + b"\r\n"
        body = b'{"prompt":"x"}' if method == b"POST" else b""
        connection.send(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        harness.pool.run_all()
        return split_response(connection.output())

    def test_dns_names_refused_without_a_key(self):
        """Host rebind.evil.example: 403 host_not_allowed on every route and method, the engine untouched;
        localhost, *.localhost, IP addresses (v4, v6, with ports), single labels and no Host pass."""
        harness = APIHarness()
        for method, path in ((b"GET", b"/v1/models"), (b"GET", b"/health"), (b"POST", b"/v1/completions"),
                             (b"OPTIONS", b"/v1/completions"), (b"GET", b"/nope")):
            for host in (b"rebind.evil.example", b"rebind.evil.example:8080", b"EVIL.example.", b"localhost.evil.example",
                         b"127.0.0.1.nip.io"):
                status, _, body = self.status(harness, host, method, path)
                self.assertEqual(status, 403, (host, path))
                self.assertEqual(error_of(self, body)["code"], "host_not_allowed")
        self.assertEqual(harness.backend.calls, [])
        for host in (b"localhost", b"localhost:8080", b"app.localhost", b"127.0.0.1", b"127.0.0.1:8080", b"[::1]:8080",
                     b"[::1]", b"192.168.1.5:8080", b"x", b"myhost", None):
            self.assertEqual(self.status(harness, host)[0], 200, host)

    def test_allow_host_and_api_key(self):
        """--allow-host admits the names given (any case, a trailing dot, any port); an API key lifts the check."""
        harness = APIHarness(allowed_hosts=("api.example.com",))
        self.assertEqual(self.status(harness, b"api.example.com")[0], 200)
        self.assertEqual(self.status(harness, b"API.Example.COM.:443")[0], 200)
        self.assertEqual(self.status(harness, b"other.example.com")[0], 403)
        harness = APIHarness(api_key=KEY)
        self.assertEqual(self.status(harness, b"rebind.evil.example")[0], 401)
        self.assertEqual(self.status(harness, b"rebind.evil.example", key=KEY)[0], 200)
        self.assertEqual(self.status(APIHarness(allowed_hosts=("*",)), b"any.example")[0], 200)
