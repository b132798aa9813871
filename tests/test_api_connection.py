"""Connection rules, at the byte level on a StringTransport, with time from a MemoryReactorClock.

Pins: the 60 s idle timeout is the reactor's (nothing happens at 59 s, the connection closes at 60 s),
every response carries Connection: close and ends its connection, bodies over 8 MiB and chunked
bodies are refused before the resource parses them, heads over 16 KiB are refused, and one log
line per request names the client, the path, the status and the token counts with speeds.
"""

import json
import unittest

from twisted.logger import globalLogPublisher

from krafla_twisted.api.site import IDLE_TIMEOUT_SECONDS, MAX_BODY_BYTES, MAX_HEADER_BYTES
from tests.support.fake_backend import APIHarness, RawConnection, split_response


class TimeoutTests(unittest.TestCase):
    """A connection silent for 60 seconds is closed by the reactor's clock."""

    def test_silent_connection_closed_at_60_seconds(self):
        """No bytes at all: open at 59.9 s, closed at 60 s."""
        self.assertEqual(IDLE_TIMEOUT_SECONDS, 60)
        harness = APIHarness()
        connection = RawConnection(harness)
        harness.reactor.advance(59.9)
        self.assertFalse(connection.transport.disconnecting)
        harness.reactor.advance(0.1)
        self.assertTrue(connection.transport.disconnecting)

    def test_half_sent_body_times_out_from_last_byte(self):
        """Each received byte restarts the clock: a body trickling in stays open until 60 s of silence
        (within the absolute deadline for the whole request, pinned in test_hardening_http)."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{")
        harness.reactor.advance(50)
        connection.send(b" ")
        harness.reactor.advance(50)
        self.assertFalse(connection.transport.disconnecting)
        harness.reactor.advance(10)
        self.assertTrue(connection.transport.disconnecting)

    def test_long_generation_is_not_a_silent_connection(self):
        """While the server works on a request, the client's silence does not close the connection."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "x"})
        harness.reactor.advance(600)
        self.assertFalse(connection.transport.disconnecting)
        harness.pool.run_all()
        self.assertEqual(split_response(connection.output())[0], 200)


class ConnectionCloseTests(unittest.TestCase):
    """HTTP/1.1 without keep-alive."""

    def test_every_response_closes(self):
        """Success, error and streamed responses all say Connection: close and close the connection."""
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/completions", {"prompt": 5}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})):
            harness = APIHarness()
            connection = RawConnection(harness)
            connection.post(path, body)
            harness.pool.run_all()
            status, headers, _ = split_response(connection.output())
            self.assertEqual(headers["connection"], "close", (path, body))
            self.assertTrue(connection.transport.disconnecting)
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        self.assertEqual(split_response(connection.output())[1]["connection"], "close")
        self.assertTrue(connection.transport.disconnecting)

    def test_pipelined_second_request_ignored(self):
        """A second request sent on the same connection gets no answer: the connection ends after one."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(connection.output().count(b"HTTP/1.1 "), 1)


class LimitTests(unittest.TestCase):
    """Request bodies up to 8 MiB, heads up to 16 KiB."""

    def test_body_over_8_mib_refused(self):
        """Content-Length above 8 MiB is 413 with an OpenAI error body; the engine never sees it."""
        self.assertEqual(MAX_BODY_BYTES, 8 * 1024 * 1024)
        harness = APIHarness()
        connection = RawConnection(harness)
        prompt = "a" * MAX_BODY_BYTES
        connection.post("/v1/completions", {"prompt": prompt})
        status, headers, body = split_response(connection.output())
        self.assertEqual(status, 413)
        self.assertEqual(json.loads(body)["error"]["code"], "request_too_large")
        self.assertEqual(harness.pool.pending, [])

    def test_body_of_8_mib_accepted(self):
        """A body of exactly 8 MiB is read and parsed (it reaches validation)."""
        harness = APIHarness()
        connection = RawConnection(harness)
        filler = " " * (MAX_BODY_BYTES - len(b'{"prompt": 7}'))
        connection.post("/v1/completions", ('{"prompt": 7}' + filler).encode())
        status, _, body = split_response(connection.output())
        self.assertEqual(status, 400)
        self.assertEqual(json.loads(body)["error"]["param"], "prompt")

    def test_chunked_body_refused(self):
        """A chunked request body is 411: the server takes only bodies with a Content-Length."""
        harness = APIHarness()
        connection = RawConnection(harness)
        connection.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"e\r\n{\"prompt\":\"x\"}\r\n0\r\n\r\n")
        status, _, body = split_response(connection.output())
        self.assertEqual(status, 411)
        self.assertIn("Content-Length", json.loads(body)["error"]["message"])
        self.assertEqual(harness.pool.pending, [])

    def test_head_over_16_kib_refused(self):
        """A request head over 16 KiB (one long header or many) is 431 and the connection closed; one under passes."""
        self.assertEqual(MAX_HEADER_BYTES, 16 * 1024)
        harness = APIHarness()
        for head in (b"X-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n", (b"X-Many: " + b"a" * 90 + b"\r\n") * 200):
            connection = RawConnection(harness)
            connection.send(b"GET /health HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            status, headers, body = split_response(connection.output())
            self.assertEqual(status, 431)
            self.assertEqual(json.loads(body)["error"]["code"], "headers_too_large")
            self.assertTrue(connection.transport.disconnecting)
        connection = RawConnection(harness)
        connection.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES - 100) + b"\r\n\r\n")
        self.assertEqual(split_response(connection.output())[0], 200)


class RequestLogTests(unittest.TestCase):
    """One line per request on the log."""

    def setUp(self):
        self.lines = []
        self.observer = lambda event: self.lines.append(event["line"]) if event.get("log_namespace") == "krafla.http" else None
        globalLogPublisher.addObserver(self.observer)
        self.addCleanup(globalLogPublisher.removeObserver, self.observer)

    def test_completion_line(self):
        """Client, method and path, status, prompt and reply tokens with tokens/s (from the result's timings)."""
        harness = APIHarness()
        harness.backend.cached_tokens = 1
        connection = RawConnection(harness)
        connection.post("/v1/completions", {"prompt": "one two three"})
        harness.pool.run_all()
        # FakeResult: 4 prompt tokens (1 cached) in 0.5 s -> 6.0 t/s; 5 reply tokens in 0.25 s -> 20.0 t/s.
        self.assertEqual(self.lines, [
            "127.0.0.1 POST /v1/completions 200 prompt 4 tokens (1 cached) 6.0 t/s, reply 5 tokens 20.0 t/s"])

    def test_other_lines(self):
        """Non-completion requests and errors get one line with the status; a client that left says so."""
        harness = APIHarness()
        RawConnection(harness).send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        RawConnection(harness).post("/v1/completions", {"prompt": []})
        gone = RawConnection(harness)
        gone.post("/v1/completions", {"prompt": "x"})
        gone.lose()
        self.assertEqual(len(self.lines), 2, "a lost client's line waits for its job")
        harness.pool.run_all()
        self.assertEqual(self.lines, ["127.0.0.1 GET /v1/models 200", "127.0.0.1 POST /v1/completions 400",
                                      "127.0.0.1 POST /v1/completions client gone"])

    def test_client_gone_while_generating(self):
        """A client that leaves mid-reply is logged when generation stops, with the tokens made until then."""
        harness = APIHarness()
        connection = RawConnection(harness)
        harness.backend.after_piece = lambda index: connection.lose() if index == 1 else None
        connection.post("/v1/completions", {"prompt": "a b c", "stream": True})
        harness.pool.run_all()
        self.assertEqual(self.lines, ["127.0.0.1 POST /v1/completions client gone "
                                      "prompt 4 tokens (0 cached) 8.0 t/s, reply 2 tokens 8.0 t/s"])
