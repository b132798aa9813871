"""Fuzzing, bounded so it runs in `make test`: hypothesis over the JSON request schema (as text, with
the pathologies a JSON library lets through) and raw bytes into the HTTP channel.

Properties: no input makes a 500, an unhandled error in the log, or an exception out of the protocol;
a JSON body is answered 200 or 400 with the OpenAI error body and reaches the engine only when valid;
every connection ends within the receive and write deadlines whatever was sent; no spelling of a path
is served without the API key except /health.
"""

import json
import os
import unittest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.logger import globalLogPublisher

from krafla_twisted.api.page import load_page_files
from krafla_twisted.api.site import REQUEST_DEADLINE_SECONDS, WRITE_DEADLINE_SECONDS
from tests.support.fake_backend import APIHarness, RawConnection

# KRAFLA_FUZZ_EXAMPLES=5000 for a longer run by hand; make test runs 200 per property.
BOUNDED = settings(max_examples=int(os.environ.get("KRAFLA_FUZZ_EXAMPLES", "200")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = "fuzz-key"
STATUS_OK = {200, 204, 400, 401, 403, 404, 405, 408, 411, 413, 431, 503}

valid_chat = st.fixed_dictionaries({
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                                "content": st.text(max_size=20)}), min_size=1, max_size=3)},
    optional={"max_tokens": st.integers(1, 50), "temperature": st.floats(0, 2), "stream": st.booleans(),
              "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4), "seed": st.integers(0, 2**64 - 1)})
valid_text = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 999), min_size=1, max_size=8)},
    optional={"max_tokens": st.integers(1, 50), "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
              "stream": st.booleans(), "repeat_penalty": st.floats(0.5, 2)})
# Fragments a JSON library accepts or a client might send, spliced into the text of a valid body.
POISON = st.sampled_from([
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "18446744073709551616", "-0", "1E400",
    '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', "[" * 40 + "]" * 40, '{"a":' * 40 + "1" + "}" * 40, "[" * 3000,
    "true", "null", '"x"', "{}", "[]", "0.1e-400", "\"" + "\\" * 3 + "\"",
])


def _splice(text, position, fragment):
    position = min(position, len(text))
    return text[:position] + fragment + text[position:]


@st.composite
def hostile_json(draw, kind):
    """The text of a valid request of `kind`, then one or more of: a field's value replaced by a poison
    fragment, a key repeated, a poison spliced anywhere, cut short, or a byte that is not UTF-8."""
    body = draw(valid_chat if kind == "chat" else valid_text)
    operations = draw(st.lists(st.sampled_from(["value", "duplicate", "splice", "truncate", "bytes"]), min_size=1, max_size=3))
    text = json.dumps(body)
    raw = None
    for operation in operations:
        if operation == "value":
            key = draw(st.sampled_from(sorted(body) + ["n", "seed", "max_completion_tokens", "stream_options"]))
            text = text[:-1] + (", " if len(text) > 2 else "") + json.dumps(key) + ": " + draw(POISON) + "}"
        elif operation == "duplicate":
            key = draw(st.sampled_from(sorted(body)))
            text = text[:-1] + ", " + json.dumps(key) + ": " + json.dumps(body[key]) + "}"
        elif operation == "splice":
            text = _splice(text, draw(st.integers(0, len(text))), draw(POISON))
        elif operation == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
        else:
            raw = bytearray(text.encode("utf-8"))
            raw.insert(draw(st.integers(0, len(raw))), draw(st.sampled_from([0x80, 0xC0, 0xFF, 0xED, 0xF8])))
    return bytes(raw) if raw is not None else text.encode("utf-8", "surrogatepass")


class FailureWatch:
    """Collects log events that carry a failure (an unhandled error anywhere in the server)."""

    def __init__(self):
        self.failures = []

    def __call__(self, event):
        if event.get("log_failure") is not None or event.get("isError"):
            self.failures.append(event)

    def __enter__(self):
        globalLogPublisher.addObserver(self)
        return self

    def __exit__(self, *exc):
        globalLogPublisher.removeObserver(self)


class JSONFuzzTests(unittest.TestCase):
    """hypothesis over the request schema, as text."""

    harness = APIHarness()

    @BOUNDED
    @given(st.sampled_from(["chat", "text"]).flatmap(lambda kind: st.tuples(st.just(kind), hostile_json(kind))))
    def test_hostile_json_is_200_or_400(self, case):
        """200 only for a body that parses as a valid request; otherwise 400 with the error body; the engine
        is called once per 200 and never for a 400; no failure is logged."""
        kind, raw = case
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        calls = len(self.harness.backend.calls)
        with FailureWatch() as watch:
            response, body = self.harness.fetch("POST", path, raw)
        self.assertIn(response.code, (200, 400), (raw[:200], body[:300]))
        self.assertEqual(watch.failures, [])
        self.assertEqual(len(self.harness.backend.calls) - calls, 1 if response.code == 200 else 0)
        if response.code == 400:
            error = json.loads(body)["error"]
            self.assertEqual(set(error), {"message", "type", "param", "code"})
            self.assertEqual(error["type"], "invalid_request_error")


METHODS = [b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"PATCH", b"TRACE", b"CONNECT", b"get", b"", b"G\x00T"]
PATHS = [b"/health", b"/v1/models", b"/v1/completions", b"/v1/chat/completions", b"//v1/models", b"*", b"",
         b"http://x/v1/models", b"/v1/models/fake-model", b"/%00", b"/\xff", b"/v1/models?" + b"a" * 100, b"/../../etc/passwd"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1 x", b"", b"http/1.1", b"HTTP/9"]
HEADERS = [b"Host: x", b"Content-Length: 14", b"Content-Length: 0", b"Content-Length: -5", b"Content-Length: 99999999999",
           b"Content-Length: 14, 15", b"Content-Length: abc", b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip",
           b"Expect: 100-continue", b"Connection: keep-alive", b"Connection: Upgrade", b"Upgrade: h2c",
           b"Authorization: Bearer " + KEY.encode(), b"Authorization: Bearer", b"Authorization: bearer " + KEY.encode(),
           b"Origin: http://evil.example", b"X-Folded: a\r\n b", b"NoColon", b": empty-name", b"X: \x00\xff",
           b"Content-Type: application/json", b"X-Long: " + b"a" * 4000, b"Host: rebind.evil.example",
           b"Host: localhost:8080", b"Host: [::1]:1"]
BODIES = [b"", b'{"prompt":"x"}', b"e\r\n{\"prompt\":\"x\"}\r\n0\r\n\r\n", b"0\r\n\r\n", b"zz\r\n", b"\x00" * 20,
          b'{"messages":[{"role":"user","content":"hi"}]}', b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"]


@st.composite
def raw_requests(draw):
    """Bytes that look like HTTP requests (from parts, some broken), or plain random bytes."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=300))
    line = b" ".join([draw(st.sampled_from(METHODS)), draw(st.sampled_from(PATHS)), draw(st.sampled_from(VERSIONS))])
    headers = draw(st.lists(st.sampled_from(HEADERS), max_size=6))
    ending = draw(st.sampled_from([b"\r\n", b"\n", b"\r\n\r\n"]))
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + ending + draw(st.sampled_from(BODIES))


def _split(data, cuts):
    points = sorted({min(c, len(data)) for c in cuts})
    pieces, start = [], 0
    for point in points + [len(data)]:
        pieces.append(data[start:point])
        start = point
    return [p for p in pieces if p]


class RawHTTPFuzzTests(unittest.TestCase):
    """Bytes into the HTTP channel, in random pieces."""

    @BOUNDED
    @given(raw_requests(), st.lists(st.integers(0, 400), max_size=4), st.booleans())
    def test_any_bytes(self, data, cuts, with_key):
        """No exception out of the protocol and no failure logged; an answer (if any) is an HTTP status we
        send, never 500; the connection is closed within the receive and write deadlines."""
        harness = APIHarness(api_key=KEY if with_key else None)
        with FailureWatch() as watch:
            connection = RawConnection(harness)
            for piece in _split(data, cuts):
                connection.send(piece)
            harness.pool.run_all()
            harness.reactor.advance(REQUEST_DEADLINE_SECONDS + WRITE_DEADLINE_SECONDS + 1)
            harness.pool.run_all()
        self.assertEqual(watch.failures, [], data)
        output = connection.output()
        if output:
            self.assertRegex(output[:13], rb"^HTTP/1\.[01] \d{3} ", data)
            status = int(output[9:12])
            if status == 100:
                status = int(output.split(b"\r\n\r\n", 1)[1][9:12] or b"100")
            self.assertIn(status, STATUS_OK | {100}, (data, output[:200]))
        self.assertTrue(connection.transport.disconnecting, data)


SEGMENTS = ["", ".", "..", "v1", "V1", "chat", "completions", "models", "health", "fake-model", "%2e", "%2f", "%76%31",
            "models%2f", "x", "health;x", "models?x=1"]


class PathFuzzTests(unittest.TestCase):
    """Any path built from the routes' segments and their disguises."""

    harness = APIHarness(api_key=KEY)

    def status(self, method, path, key):
        connection = RawConnection(self.harness)
        body = b'{"prompt":"x"}' if method == b"POST" else b""
        auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n" if key else b""
        connection.send(method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n" + auth
                        + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.harness.pool.run_all()
        output = connection.output()
        return int(output[9:12]), output.split(b"\r\n\r\n", 1)[1]

    @BOUNDED
    @given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=5), st.sampled_from([b"GET", b"POST", b"HEAD"]))
    def test_no_path_served_without_the_key_but_health(self, segments, method):
        """Without the key: 401, or 404 for what routes nowhere, or /health's own answer, or the chat page
        at / (api/page.py: it calls the API with the key); never another 200."""
        path = ("/" + "/".join(segments)).encode()
        status, body = self.status(method, path, key=False)
        open_answers = ((200, b'{"status": "ok"}'), (200, load_page_files()["index.html"].body))
        if self.status(b"GET", path, key=False) in open_answers:
            self.assertIn(status, (200, 405), path)  # /health and the page: open, GET and HEAD only
        else:
            self.assertIn(status, (401, 404), path)
            with_key = self.status(method, path, key=True)[0]
            if with_key == 200:
                self.assertEqual(status, 401, path)
