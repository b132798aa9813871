"""The Resource tree in memory (StubTreq over the server's own Site, a scripted backend, no threads).

What these pin is the HTTP contract of the original: paths with and without /v1, response shapes,
streaming framing, errors, auth, CORS, queueing and cancellation. The real model's answers are
pinned in tests/test_server_*.py.
"""

import json
import unittest
from unittest import mock

from krafla_twisted.api import access as access_module
from tests.support.fake_backend import APIHarness, RawConnection, fired, split_response, sse_events

CHAT = {"model": "anything", "messages": [{"role": "user", "content": "Say hello"}]}


def error_of(body):
    payload = json.loads(body)
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    return payload["error"]


class EndpointTests(unittest.TestCase):
    """Each endpoint answers in OpenAI's shape, under /v1 and without it."""

    def setUp(self):
        self.harness = APIHarness()

    def test_health(self):
        """/health and /v1/health answer {"status": "ok"}."""
        for path in ("/health", "/v1/health"):
            response, body = self.harness.fetch("GET", path)
            self.assertEqual(response.code, 200)
            self.assertEqual(json.loads(body), {"status": "ok"})

    def test_models_list_and_one(self):
        """/v1/models lists the one model; /v1/models/{id} returns it; another id is 404 model_not_found."""
        for prefix in ("/v1", ""):
            response, body = self.harness.fetch("GET", prefix + "/models")
            listing = json.loads(body)
            self.assertEqual(listing["object"], "list")
            self.assertEqual([m["id"] for m in listing["data"]], ["fake-model"])
            self.assertEqual(listing["data"][0]["object"], "model")
            response, body = self.harness.fetch("GET", prefix + "/models/fake-model")
            self.assertEqual((response.code, json.loads(body)), (200, listing["data"][0]))
            response, body = self.harness.fetch("GET", prefix + "/models/gpt-4o")
            self.assertEqual(response.code, 404)
            self.assertEqual(error_of(body)["code"], "model_not_found")

    def test_model_id_with_slash(self):
        """A model id with '/' (an alias like org/name) is looked up whole, percent-escapes decoded."""
        self.harness.backend.model_id = "org/name"
        response, body = self.harness.fetch("GET", "/v1/models/org/name")
        self.assertEqual(json.loads(body)["id"], "org/name")
        response, body = self.harness.fetch("GET", "/v1/models/org%2Fname")
        self.assertEqual(response.code, 200)

    def test_unknown_path_is_404(self):
        """Unknown paths and /v1 itself are 404 with an OpenAI error body (/ is the chat page: test_chat_page.py)."""
        for path in ("/v1", "//v1", "/ui", "/ui/", "/ui/index.html", "/ui/app.js/x", "/v1/embeddings/extra", "/v1/chat", "/v1/completions/extra", "/v2/models"):
            response, body = self.harness.fetch("GET", path)
            self.assertEqual(response.code, 404, path)
            self.assertIn("Invalid URL", error_of(body)["message"])

    def test_wrong_method_is_405(self):
        """GET on a POST endpoint and POST on a GET endpoint are 405 with Allow."""
        response, body = self.harness.fetch("GET", "/v1/chat/completions")
        self.assertEqual(response.code, 405)
        self.assertEqual(response.headers.getRawHeaders("allow"), ["POST"])
        self.assertEqual(error_of(body)["type"], "invalid_request_error")
        response, body = self.harness.fetch("POST", "/v1/models", {})
        self.assertEqual(response.code, 405)
        response, body = self.harness.fetch("DELETE", "/completions")
        self.assertEqual(response.code, 405)

    def test_chat_completion_shape(self):
        """A chat reply is a chat.completion with the message, finish_reason and usage with cached tokens."""
        self.harness.backend.cached_tokens = 1
        response, body = self.harness.fetch("POST", "/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        reply = json.loads(body)
        self.assertEqual(reply["object"], "chat.completion")
        self.assertTrue(reply["id"].startswith("chatcmpl-"))
        self.assertEqual(reply["model"], "fake-model")
        self.assertEqual(
            reply["choices"],
            [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!", "refusal": None},
              "logprobs": None, "finish_reason": "stop"}],
        )
        self.assertEqual(
            reply["usage"],
            {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 1},
             "completion_tokens_details": {"reasoning_tokens": 0}},
        )

    def test_text_completion_shape_and_max_tokens(self):
        """A text reply is a text_completion; max_tokens reaches the generator and gives finish_reason length."""
        response, body = self.harness.fetch("POST", "/completions", {"prompt": "Once upon", "max_tokens": 2})
        reply = json.loads(body)
        self.assertEqual(reply["object"], "text_completion")
        self.assertTrue(reply["id"].startswith("cmpl-"))
        self.assertEqual(reply["choices"], [{"index": 0, "text": "Hello,", "logprobs": None, "finish_reason": "length"}])
        self.assertEqual(self.harness.backend.calls[-1].max_tokens, 2)

    def test_request_fields_reach_the_backend(self):
        """Every field the original names is passed on: sampling, stop, max_completion_tokens, prompt ids."""
        body = {"messages": [{"role": "system", "content": "Be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
                "temperature": 0.7, "top_p": 0.5, "top_k": 40, "repetition_penalty": 1.1, "repeat_last_n": 32,
                "seed": 42, "stop": "\n", "max_completion_tokens": 9, "max_tokens": 3,
                "frequency_penalty": 0.5, "presence_penalty": -1.5, "min_p": 0.05, "ignore_eos": True, "user": "ignored"}
        self.harness.fetch("POST", "/v1/chat/completions", body)
        call = self.harness.backend.calls[-1]
        self.assertEqual(call.messages, ({"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi there"}))
        self.assertEqual((call.sampling.temperature, call.sampling.top_p, call.sampling.top_k), (0.7, 0.5, 40))
        self.assertEqual((call.sampling.repeat_penalty, call.sampling.repeat_last_n, call.sampling.seed), (1.1, 32, 42))
        self.assertEqual((call.sampling.frequency_penalty, call.sampling.presence_penalty, call.sampling.min_p),
                         (0.5, -1.5, 0.05))
        self.assertTrue(call.ignore_eos)
        self.assertEqual((call.stop, call.max_tokens), (("\n",), 9))
        self.harness.fetch("POST", "/v1/completions", {"prompt": [[5, 6, 7]], "stop": ["a", "b"]})
        call = self.harness.backend.calls[-1]
        self.assertEqual((call.prompt_tokens, call.prompt_text, call.stop), ((5, 6, 7), None, ("a", "b")))

    def test_chat_without_template(self):
        """Without --chat the chat endpoint is refused with 400; text completions still work."""
        self.harness.backend.has_chat = False
        response, body = self.harness.fetch("POST", "/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 400)
        self.assertIn("--chat", error_of(body)["message"])
        response, body = self.harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        self.assertEqual(response.code, 200)

    def test_context_length_exceeded(self):
        """A prompt that does not fit is 400 context_length_exceeded, streamed or not, as a plain HTTP error."""
        long_prompt = "word " * 100
        for stream in (False, True):
            response, body = self.harness.fetch("POST", "/v1/completions", {"prompt": long_prompt, "stream": stream})
            self.assertEqual(response.code, 400)
            self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
            error = error_of(body)
            self.assertEqual((error["code"], error["param"]), ("context_length_exceeded", "prompt"))

    def test_engine_failure_is_500_json(self):
        """An unexpected engine error is a 500 with an OpenAI body of type server_error, not a traceback page."""
        self.harness.backend.error = RuntimeError("the engine broke")
        response, body = self.harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        self.assertEqual(response.code, 500)
        error = error_of(body)
        self.assertEqual(error["type"], "server_error")
        self.assertIn("the engine broke", error["message"])


class StreamingTests(unittest.TestCase):
    """Server-sent events in OpenAI's chunk shapes, ending with data: [DONE]."""

    def setUp(self):
        self.harness = APIHarness()

    def stream(self, path, body):
        response, raw = self.harness.fetch("POST", path, body)
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/event-stream; charset=utf-8"])
        return sse_events(raw)

    def test_chat_stream(self):
        """Chat chunks: a role chunk, one content delta per piece, a finish chunk, then [DONE]; no usage keys."""
        events = self.stream("/v1/chat/completions", dict(CHAT, stream=True))
        self.assertEqual(events[-1], "[DONE]")
        chunks = events[:-1]
        self.assertEqual({c["object"] for c in chunks}, {"chat.completion.chunk"})
        self.assertEqual(len({c["id"] for c in chunks}), 1)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        self.assertEqual(deltas[0], {"role": "assistant", "content": ""})
        self.assertEqual("".join(d.get("content", "") for d in deltas), "Hello, world!")
        self.assertEqual(deltas[-1], {})
        self.assertEqual([c["choices"][0]["finish_reason"] for c in chunks], [None] * (len(chunks) - 1) + ["stop"])
        self.assertTrue(all("usage" not in c for c in chunks))

    def test_include_usage(self):
        """With include_usage every chunk has usage null and a last chunk has no choices and the usage."""
        events = self.stream("/v1/chat/completions", dict(CHAT, stream=True, stream_options={"include_usage": True}))
        chunks = events[:-1]
        self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 5)
        self.assertEqual(chunks[-1]["usage"]["total_tokens"], 8)

    def test_text_stream(self):
        """Text completion chunks are text_completion objects with text pieces, finish_reason last."""
        events = self.stream("/v1/completions", {"prompt": "Once", "stream": True, "max_tokens": 3,
                                                 "stream_options": {"include_usage": True}})
        chunks = events[:-1]
        self.assertEqual({c["object"] for c in chunks}, {"text_completion"})
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks[:-1]), "Hello, wor")
        self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 3)

    def test_error_after_streaming_started(self):
        """An error after the first event can only travel as an error event; the stream still ends with [DONE]."""
        def explode(index):
            if index == 1:
                raise RuntimeError("out of memory")

        self.harness.backend.after_piece = explode
        events = self.stream("/v1/completions", {"prompt": "Once", "stream": True})
        self.assertEqual(events[0]["choices"][0]["text"], "Hello")
        self.assertEqual(events[-2]["error"]["type"], "server_error")
        self.assertEqual(events[-1], "[DONE]")


class QueueTests(unittest.TestCase):
    """One worker, arrival order, and what happens when a client goes."""

    def setUp(self):
        self.harness = APIHarness()

    def test_requests_answered_in_arrival_order(self):
        """Requests queue; the first in is the first run, and nothing runs until the worker takes it."""
        first = self.harness.send("POST", "/v1/completions", {"prompt": "first"}, run=False)
        second = self.harness.send("POST", "/v1/completions", {"prompt": "second"}, run=False)
        self.assertEqual(len(self.harness.pool.pending), 2)
        self.assertEqual(self.harness.backend.calls, [])
        self.harness.pool.run_next()
        self.harness.stub.flush()
        self.assertEqual([c.prompt_text for c in self.harness.backend.calls], ["first"])
        self.assertEqual(fired(first).code, 200)
        self.harness.pool.run_next()
        self.harness.stub.flush()
        self.assertEqual([c.prompt_text for c in self.harness.backend.calls], ["first", "second"])
        self.assertEqual(fired(second).code, 200)

    def test_queued_client_that_leaves_is_dropped(self):
        """A client that disconnects while queued never reaches the engine; the next request is served."""
        gone = RawConnection(self.harness)
        gone.post("/v1/completions", {"prompt": "never"})
        stays = RawConnection(self.harness)
        stays.post("/v1/completions", {"prompt": "served"})
        gone.lose()
        self.harness.pool.run_all()
        self.assertEqual([c.prompt_text for c in self.harness.backend.calls], ["served"])
        self.assertEqual(split_response(stays.output())[0], 200)
        self.assertEqual(gone.output(), b"")

    def test_running_client_that_leaves_stops_generation(self):
        """A streaming client that disconnects mid-reply stops generation at the next token."""
        connection = RawConnection(self.harness)
        self.harness.backend.after_piece = lambda index: connection.lose() if index == 1 else None
        connection.post("/v1/chat/completions", dict(CHAT, stream=True))
        self.harness.pool.run_all()
        events = sse_events(split_response(connection.output())[2])
        self.assertEqual([e["choices"][0]["delta"] for e in events], [{"role": "assistant", "content": ""},
                                                                      {"content": "Hello"}, {"content": ","}])
        self.assertEqual(self.harness.backend.results[-1].finish_reason, "cancelled")
        self.assertEqual(self.harness.backend.results[-1].text, "Hello,")

    def test_non_streaming_client_that_leaves_stops_generation(self):
        """A waiting non-streaming client that disconnects also cancels its generation (seen by the generator)."""
        connection = RawConnection(self.harness)
        seen = []

        def leave(index):
            if index == 0:
                connection.lose()
            seen.append(index)

        self.harness.backend.after_piece = leave
        connection.post("/v1/completions", {"prompt": "x"})
        self.harness.pool.run_all()
        self.assertEqual(seen, [0])
        self.assertEqual(connection.output(), b"")

    def test_shutdown_cancels_every_job(self):
        """Stopping the worker cancels queued jobs, so shutdown waits for at most one token."""
        self.harness.send("POST", "/v1/completions", {"prompt": "a"}, run=False)
        self.harness.worker.stop()
        self.harness.pool.run_all()
        self.assertEqual(self.harness.backend.calls, [])
        self.assertTrue(self.harness.pool.stopped)


class BackpressureTests(unittest.TestCase):
    """The SSE producer honours pauseProducing/resumeProducing from the transport."""

    def test_paused_stream_holds_events_until_resumed(self):
        """While the transport is paused nothing is written; on resume everything follows, in order."""
        harness = APIHarness()
        connection = RawConnection(harness)
        writes = []

        def pause_after_first(index):
            if index == 0:
                connection.protocol.pauseProducing()
                writes.append(len(connection.output()))
            if index == 3:
                writes.append(len(connection.output()))

        harness.backend.after_piece = pause_after_first
        connection.post("/v1/completions", {"prompt": "x", "stream": True})
        harness.pool.run_all()
        self.assertEqual(writes[0], writes[1], "written while paused")
        paused_output = connection.output()
        self.assertNotIn(b"[DONE]", paused_output)
        connection.protocol.resumeProducing()
        events = sse_events(split_response(connection.output())[2])
        self.assertEqual("".join(e["choices"][0]["text"] for e in events[:-1]), "Hello, world!")
        self.assertEqual(events[-1], "[DONE]")
        self.assertTrue(connection.transport.disconnecting)


class AuthTests(unittest.TestCase):
    """--api-key: every endpoint but /health needs `Authorization: Bearer KEY`."""

    def setUp(self):
        self.harness = APIHarness(api_key="s3cret")

    def test_missing_and_wrong_key(self):
        """No header, a wrong key, or another scheme: 401 invalid_api_key, also on unknown paths."""
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer "}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/nothing")):
                response, body = self.harness.fetch(method, path, CHAT if method == "POST" else None, headers)
                self.assertEqual(response.code, 401, (headers, path))
                self.assertEqual(error_of(body)["code"], "invalid_api_key")
        self.assertEqual(self.harness.backend.calls, [])

    def test_right_key(self):
        """The right key is let through; /health needs none."""
        response, _ = self.harness.fetch("POST", "/v1/chat/completions", CHAT, {"Authorization": "Bearer s3cret"})
        self.assertEqual(response.code, 200)
        response, _ = self.harness.fetch("GET", "/health")
        self.assertEqual(response.code, 200)

    def test_key_compared_in_constant_time(self):
        """The key goes through hmac.compare_digest, whose time does not depend on the first differing byte."""
        with mock.patch.object(access_module.hmac, "compare_digest", wraps=access_module.hmac.compare_digest) as spy:
            self.harness.fetch("GET", "/v1/models", None, {"Authorization": "Bearer s3creT"})
        spy.assert_called_once_with(b"s3creT", b"s3cret")


class CORSTests(unittest.TestCase):
    """--cors ORIGIN lets that origin read replies; preflight requests are answered."""

    def test_allowed_origin(self):
        """The allowed origin gets Access-Control-Allow-Origin on replies and on errors."""
        harness = APIHarness(cors_origins=("http://app.example",))
        response, _ = harness.fetch("GET", "/v1/models", None, {"Origin": "http://app.example"})
        self.assertEqual(response.headers.getRawHeaders("access-control-allow-origin"), ["http://app.example"])
        response, _ = harness.fetch("GET", "/v1/nope", None, {"Origin": "http://app.example"})
        self.assertEqual(response.headers.getRawHeaders("access-control-allow-origin"), ["http://app.example"])
        response, _ = harness.fetch("GET", "/v1/models", None, {"Origin": "http://evil.example"})
        self.assertIsNone(response.headers.getRawHeaders("access-control-allow-origin"))

    def test_preflight_without_key(self):
        """OPTIONS preflight is answered 204 with methods and headers, without the API key."""
        harness = APIHarness(api_key="k", cors_origins=("*",))
        response, body = harness.fetch("OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://any.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        self.assertEqual(response.code, 204)
        self.assertEqual(response.headers.getRawHeaders("access-control-allow-origin"), ["*"])
        self.assertIn("POST", response.headers.getRawHeaders("access-control-allow-methods")[0])
        self.assertEqual(response.headers.getRawHeaders("access-control-allow-headers"), ["authorization, content-type"])

    def test_no_cors_by_default(self):
        """Without --cors no reply carries CORS headers, so a browser page cannot read it."""
        harness = APIHarness()
        response, _ = harness.fetch("OPTIONS", "/v1/chat/completions", None, {"Origin": "http://a.example",
                                                                             "Access-Control-Request-Method": "POST"})
        self.assertIsNone(response.headers.getRawHeaders("access-control-allow-origin"))
        response, _ = harness.fetch("GET", "/v1/models", None, {"Origin": "http://a.example"})
        self.assertIsNone(response.headers.getRawHeaders("access-control-allow-origin"))


class InternalErrorTests(unittest.TestCase):
    """A bug in a resource still answers in the API's shape."""

    def test_unexpected_exception_is_500_json(self):
        """An exception that is not an APIError is logged and answered as 500 server_error JSON."""
        from twisted.logger import globalLogPublisher

        harness = APIHarness()
        failures = []
        observer = lambda event: failures.append(event) if event.get("log_failure") else None  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        with mock.patch("krafla_twisted.api.resources.parse_json_body", side_effect=KeyError("bug")):
            response, body = harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        self.assertEqual(response.code, 500)
        self.assertEqual(error_of(body)["type"], "server_error")
        self.assertEqual(len(failures), 1)
        failures[0]["log_failure"].trap(KeyError)


class RoutesTests(unittest.TestCase):
    """krafla_twisted/api/routes.py: one table, every path with and without /v1."""

    def test_every_route_with_and_without_v1(self):
        """Each endpoint answers under both prefixes; /metrics only when the server counts."""
        harness = APIHarness()
        for path in ("/health", "/models", "/models/fake-model"):
            for prefix in ("", "/v1"):
                self.assertEqual(harness.fetch("GET", prefix + path)[0].code, 200, prefix + path)
        for prefix in ("", "/v1"):
            response, body = harness.fetch("POST", prefix + "/tokenize", {"content": "ok"})
            self.assertEqual(json.loads(body), {"tokens": [111, 107], "count": 2, "max_model_len": 64})
            response, body = harness.fetch("POST", prefix + "/detokenize", {"tokens": [111, 107]})
            self.assertEqual(json.loads(body), {"content": "ok"})
            self.assertEqual(harness.fetch("GET", prefix + "/metrics")[0].code, 404)

    def test_metrics_count_requests_of_the_site(self):
        """With a Metrics, /metrics is served and every request the Site answered is counted."""
        from krafla_twisted.api.metrics import Metrics

        counters = Metrics()
        harness = APIHarness(metrics=counters)
        harness.fetch("GET", "/health")
        harness.fetch("POST", "/v1/completions", {"prompt": "x"})
        response, body = harness.fetch("GET", "/v1/metrics")
        self.assertEqual(response.code, 200)
        text = body.decode()
        self.assertIn('krafla_requests_total{endpoint="health",status="200"} 1', text)
        self.assertIn('krafla_requests_total{endpoint="completions",status="200"} 1', text)
        self.assertIn("krafla_completions_total 1", text)
