"""A real `twistd -n krafla` process with the real SmolLM2-135M-Instruct model, driven with treq.

One server for the whole module (starting one loads the model), greedy decoding and short replies
keep it fast. What the in-memory tests cannot show is pinned here: the real model's replies through
every endpoint, KV-cache reuse giving the same reply as a cold run, stop strings cut across token
boundaries, multi-byte characters in streams, queueing and cancellation on a real socket, the
limits of the real listener, the log lines, and three real clients: the openai Python library, the
openai npm package under node, and `krafla run`.
"""

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import treq
from twisted.internet import defer

from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess, in_reactor, queue_line, treq_call

MODEL = "smollm2-135m"
ORIGIN = "http://app.example"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model():
    return real_model(MODEL)


@pytest.fixture(scope="module")
def server(model):
    # --parallel 1, the original's one reply at a time (QueueTests, CacheTests' one cache);
    # tests/test_server_concurrency.py runs several slots.
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2", "--cors", ORIGIN,
                             "--log-queue", "--parallel", "1"])
    process.start()
    yield process
    # twistd ends by re-raising SIGTERM on itself once shut down, so the status is -SIGTERM.
    assert process.stop() in (0, -signal.SIGTERM), "\n".join(process.lines[-30:])
    assert "Server Shut Down." in process.lines[-1]


call = treq_call


def post(server, path, body, **kwargs):
    status, headers, content = call("POST", server.url(path), body, **kwargs)
    return status, headers, json.loads(content) if content else None


def stream(server, path, body):
    """(status, [data payloads as received, JSON-decoded or "[DONE]"], raw pieces as they arrived)."""
    pieces = []

    @defer.inlineCallbacks
    def go():
        response = yield treq.post(server.url(path), data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"}, persistent=False, unbuffered=True)
        yield treq.collect(response, pieces.append)
        return response.code

    status = in_reactor(go)
    raw = b"".join(pieces)
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return status, events, pieces


def chat_body(content, **extra):
    return dict({"model": "local", "messages": [{"role": "user", "content": content}], "max_tokens": 16}, **extra)


def streamed_text(events):
    text = ""
    for event in events[:-1]:
        if event.get("choices"):
            choice = event["choices"][0]
            text += choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
    return text


class EndpointTests:
    """Every endpoint of the original, with the real model."""

    def test_health_models(self, server, model):
        """/health, /v1/models and /v1/models/{id} (the file name without .mlb), with and without /v1."""
        assert call("GET", server.root_url("/health"))[2] == b'{"status": "ok"}'
        model_id = os.path.splitext(os.path.basename(str(model.mlb)))[0]
        for url in (server.url("/models"), server.root_url("/models")):
            status, _, body = call("GET", url)
            assert status == 200
            assert [m["id"] for m in json.loads(body)["data"]] == [model_id]
        status, _, body = call("GET", server.url("/models/" + model_id))
        assert (status, json.loads(body)["id"]) == (200, model_id)
        assert call("GET", server.url("/models/gpt-4"))[0] == 404

    def test_chat(self, server):
        """A chat reply names Paris, has OpenAI's shape and a finish_reason of stop or length."""
        status, headers, reply = post(server, "/chat/completions", chat_body(QUESTION, max_tokens=24))
        assert status == 200
        assert reply["object"] == "chat.completion"
        message = reply["choices"][0]["message"]
        assert message["role"] == "assistant"
        assert "Paris" in message["content"]
        assert reply["choices"][0]["finish_reason"] in ("stop", "length")
        usage = reply["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert 0 < usage["completion_tokens"] <= 24

    def test_message_forms(self, server):
        """developer is the system role; content parts read as the string they join to; a final assistant message is continued."""
        def reply(messages):
            return post(server, "/chat/completions", {"messages": messages, "max_tokens": 8})[2]["choices"][0]["message"]["content"]

        as_system = reply([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"}])
        as_developer = reply([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello!"}])
        assert as_system == as_developer
        parts = reply([{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                                    {"type": "text", "text": "of France?"}]}])
        assert parts == reply([{"role": "user", "content": QUESTION}])
        start = "The capital of France is"
        continued = reply([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}])
        assert not continued.startswith(start)  # the reply goes on from the given text instead of repeating it
        assert "Paris" in continued

    def test_completion_string_and_ids(self, server, model):
        """A prompt string and the same prompt's token ids (with BOS when the tokenizer adds one) continue alike."""
        from krafla_twisted.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(str(model.mlt))
        prompt = "The capital of France is"
        status, _, by_text = post(server, "/completions", {"prompt": prompt, "max_tokens": 8})
        assert status == 200 and by_text["object"] == "text_completion"
        ids = tokenizer.encode(prompt)
        status, _, by_ids = post(server, "/completions", {"prompt": ids, "max_tokens": 8})
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
        assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)
        assert by_text["choices"][0]["finish_reason"] == "length"
        assert by_text["usage"]["completion_tokens"] == 8

    def test_ignore_eos(self, server):
        """ignore_eos (llama-server's and vLLM's, which load generators send for replies of a fixed
        length): a chat reply that ends by itself runs to max_tokens instead, and its first tokens are
        the reply's own."""
        body = chat_body(QUESTION, max_tokens=48, temperature=0)
        short = post(server, "/chat/completions", body)[2]
        assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 48
        long = post(server, "/chat/completions", dict(body, ignore_eos=True))[2]
        assert long["choices"][0]["finish_reason"] == "length" and long["usage"]["completion_tokens"] == 48
        assert long["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])

    def test_max_completion_tokens_and_seeded_sampling(self, server):
        """max_completion_tokens limits the reply; a seed with temperature > 0 repeats its reply exactly."""
        body = chat_body("Write a word.", max_tokens=None, max_completion_tokens=5, temperature=1.0, top_p=0.95,
                         top_k=40, seed=1234, repeat_penalty=1.1, repeat_last_n=16)
        first = post(server, "/chat/completions", body)[2]
        second = post(server, "/chat/completions", body)[2]
        assert first["usage"]["completion_tokens"] <= 5
        assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]

    def test_penalties_and_min_p(self, server):
        """OpenAI's penalties reach the sampler (tests/test_sampler.py checks their arithmetic against
        llama.cpp's rule): a greedy reply that repeats itself changes under each, and Ollama's options
        of the same names give the same reply as /v1. min_p 1 makes sampling greedy."""
        body = {"prompt": "Red, green, blue, red, green,", "max_tokens": 12, "temperature": 0}
        reply = lambda **extra: post(server, "/completions", dict(body, **extra))[2]["choices"][0]["text"]
        plain, frequency, presence = reply(), reply(frequency_penalty=1.5), reply(presence_penalty=2.0)
        assert plain.count(",") >= 4, plain   # SmolLM2 goes on listing the colours
        assert frequency != plain and presence != plain and frequency != presence
        assert reply(frequency_penalty=1.5) == frequency
        # min_p 1 keeps only the best token at each step: sampling at any temperature is greedy
        assert reply(temperature=1.5, seed=3, min_p=1.0) == plain != reply(temperature=1.5, seed=3)
        status, _, raw = call("POST", server.root_url("/api/generate"), {
            "model": "local", "prompt": body["prompt"], "raw": True, "stream": False,
            "options": {"temperature": 0, "num_predict": 12, "frequency_penalty": 1.5}})
        assert status == 200 and json.loads(raw)["response"] == frequency

    def test_gbnf_grammar_and_json_schema(self, server):
        """llama-server's `grammar` (GBNF, here llama.cpp's own chess grammar) and `json_schema` fields
        shape the reply, on both endpoints and through the openai library's extra_body; a grammar
        that names an undefined rule is a 400 saying where."""
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        with open(os.path.join(REPO, "tests", "data", "gbnf", "chess.gbnf"), encoding="utf-8") as f:
            chess = f.read()
        reply = client.completions.create(model="local", prompt="A game of chess:\n", max_tokens=24, temperature=0,
                                          extra_body={"grammar": chess})
        move = r"([a-h]x)?[a-h][1-8](=[NBKQR])?|[NBKQR][a-h]?[1-8]?x?[a-h][1-8]|O-O(-O)?"
        line = rf"[1-9][0-9]?\. ({move})[+#]? ({move})[+#]?\n"
        text = reply.choices[0].text
        assert text.startswith("1. ") and re.fullmatch(rf"({line})*" + r"[^\n]*", text), text
        yes_no = client.chat.completions.create(model="local", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=8, extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
        assert yes_no.choices[0].message.content in ("yes.", "no.") and yes_no.choices[0].finish_reason == "stop"
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                  "additionalProperties": False}
        shaped = client.chat.completions.create(model="local", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=30, extra_body={"json_schema": schema})
        assert set(json.loads(shaped.choices[0].message.content)) == {"city"}
        status, _, body = post(server, "/completions", {"prompt": "x", "grammar": 'root ::= "a" b'})
        assert status == 400 and body["error"]["param"] == "grammar" and "line 1 column 14" in body["error"]["message"]

    def test_errors(self, server):
        """400 invalid field, 400 context_length_exceeded (stream or not, as plain JSON), 400 for
        embeddings from a chat model (not started with --embeddings), 404, 405."""
        status, _, body = post(server, "/chat/completions", {"messages": "hi"})
        assert (status, body["error"]["param"]) == (400, "messages")
        huge = "hello " * 5000
        for streaming in (False, True):
            status, headers, body = post(server, "/chat/completions", chat_body(huge, stream=streaming))
            assert status == 400
            assert headers.getRawHeaders("content-type") == ["application/json"]
            assert body["error"]["code"] == "context_length_exceeded"
        status, _, body = post(server, "/embeddings", {"input": "x"})
        assert (status, body["error"]["code"]) == (400, "model_not_embedding")
        assert post(server, "/embeddings/extra", {"input": "x"})[0] == 404
        assert call("GET", server.url("/chat/completions"))[0] == 405

    def test_refusals(self, server):
        """The original's refusals reach a real client as 400 naming the field."""
        for path, body, param in (
            ("/chat/completions", chat_body("x", n=200), "n"),
            ("/completions", {"prompt": "x", "echo": True, "suffix": "y"}, "echo"),
            ("/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
            ("/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
            ("/completions", {"prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ):
            status, _, reply = post(server, path, body)
            assert (status, reply["error"]["param"]) == (400, param)


class StreamingTests:
    """Server-sent events from the real model."""

    def test_chat_stream_equals_plain_reply(self, server):
        """The streamed chunks join to the non-streamed reply; include_usage adds the usage chunk; [DONE] last."""
        plain = post(server, "/chat/completions", chat_body(QUESTION))[2]
        status, events, _ = stream(server, "/chat/completions",
                                   chat_body(QUESTION, stream=True, stream_options={"include_usage": True}))
        assert status == 200
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert streamed_text(events) == plain["choices"][0]["message"]["content"]
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        assert events[-3]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]

    def test_text_stream(self, server):
        """Text completion chunks join to the plain completion."""
        body = {"prompt": "Once upon a time", "max_tokens": 12}
        plain = post(server, "/completions", body)[2]
        status, events, _ = stream(server, "/completions", dict(body, stream=True))
        assert events[0]["object"] == "text_completion"
        assert streamed_text(events) == plain["choices"][0]["text"]

    def test_stop_string_across_token_boundary(self, server, model):
        """A stop string that spans two tokens ends the reply before it, streamed or not, and never leaks."""
        from krafla_twisted.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(str(model.mlt))
        body = {"prompt": "The capital of France is", "max_tokens": 16}
        full = post(server, "/completions", body)[2]["choices"][0]["text"]
        ids = tokenizer.encode(full, add_bos=False)
        pieces = [tokenizer.decode([i]).decode("utf-8", "replace") for i in ids]
        stop = None
        for k in range(2, len(pieces)):
            left, right = pieces[k - 1], pieces[k]
            candidate = left[-2:] + right[:2]
            if len(left) >= 2 and len(right) >= 2 and full.find(candidate) == len("".join(pieces[:k])) - 2:
                stop = candidate
                break
        assert stop is not None, f"no token boundary to cut in {full!r}"
        expected = full[: full.index(stop)]
        reply = post(server, "/completions", dict(body, stop=[stop, "never-seen"]))[2]
        assert reply["choices"][0]["text"] == expected
        assert reply["choices"][0]["finish_reason"] == "stop"
        status, events, _ = stream(server, "/completions", dict(body, stop=stop, stream=True))
        assert streamed_text(events) == expected
        assert all(stop not in (e["choices"][0]["text"] if e != "[DONE]" and e["choices"] else "") for e in events)

    def test_multibyte_characters_in_stream(self, server):
        """Emoji (4 UTF-8 bytes, several byte-level tokens each) stream as whole characters: no U+FFFD, the
        pieces join to the plain reply."""
        body = {"prompt": "🍎 apple\n🍌 banana\n🍇 grapes\n🍓", "max_tokens": 24}
        plain = post(server, "/completions", body)[2]["choices"][0]["text"]
        assert any(ord(c) > 0xFFFF for c in plain), plain
        status, events, raw_pieces = stream(server, "/completions", dict(body, stream=True))
        pieces = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
        assert "".join(pieces) == plain
        assert "\ufffd" not in plain
        for piece in pieces:
            piece.encode("utf-8")  # half a character would be a lone surrogate or U+FFFD


class CacheTests:
    """The KV cache across requests."""

    def test_second_turn_reuses_cache_with_same_reply_as_cold(self, server):
        """Turn two's prompt starts with turn one's: cached_tokens covers it, and the reply equals a cold run's."""
        first_messages = [{"role": "user", "content": "Name a fruit."}]
        first = post(server, "/chat/completions", {"messages": first_messages, "max_tokens": 12})[2]
        turn_two = first_messages + [first["choices"][0]["message"], {"role": "user", "content": "And a colour?"}]
        warm = post(server, "/chat/completions", {"messages": turn_two, "max_tokens": 12})[2]
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        post(server, "/completions", {"prompt": "Unrelated text to push the cache elsewhere", "max_tokens": 1})
        cold = post(server, "/chat/completions", {"messages": turn_two, "max_tokens": 12})[2]
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"]
        assert cold["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]


def raw_request(server, body, path="/v1/completions"):
    """An open socket that has sent a POST; the caller reads and closes it."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def read_all(sock):
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


class QueueTests:
    """One request at a time, in order; clients that leave."""

    def test_two_concurrent_requests_answered_in_order(self, server):
        """A second request sent while the first is being generated waits for it: the first is answered first."""
        # Counting goes on: neither reply ends before max_tokens.
        start = len(server.lines)
        first = raw_request(server, {"prompt": "1, 2, 3, 4,", "max_tokens": 24, "stream": True})
        first_reply = b""
        while b"data: " not in first_reply:  # the first is being generated before the second is sent
            first_reply += first.recv(65536)
        second = raw_request(server, {"prompt": "10, 11, 12,", "max_tokens": 4})
        first_reply += read_all(first)
        first_done = time.monotonic()
        second_reply = read_all(second)
        second_done = time.monotonic()
        assert first_reply.startswith(b"HTTP/1.1 200") and second_reply.startswith(b"HTTP/1.1 200")
        assert first_done <= second_done
        # A request's log line is written after its reply, so wait for both lines to arrive.
        server.wait_for(lambda l: "reply 4 tokens" in l, start=start)
        lines = [l for l in server.lines[start:] if "POST /v1/completions 200" in l]
        assert len(lines) == 2 and "reply 24 tokens" in lines[0] and "reply 4 tokens" in lines[1], lines

    def test_cancel_running_and_queued(self, server):
        """A streaming client that leaves stops generation at the next token; a queued one that leaves never runs."""
        start = len(server.lines)
        running = raw_request(server, {"prompt": "1, 2, 3, 4,", "max_tokens": 400, "stream": True})
        received = b""
        while b"data: " not in received:
            received += running.recv(4096)
        queued = raw_request(server, {"prompt": "queued and gone", "max_tokens": 8})
        server.wait_for(lambda l: queue_line(2) in l, start=start)  # queued behind the running one before it leaves
        mark = len(server.lines)
        queued.close()
        # The worker drops the queued request at its next step (the queue shrinks to the running one)
        # before the running client leaves: closed together, the server may see the running one go
        # first, free its slot and start the queued one before it notices that client left too.
        server.wait_for(lambda l: queue_line(1) in l, start=mark)
        running.close()
        after = post(server, "/completions", {"prompt": "Hello", "max_tokens": 2})
        assert after[0] == 200
        gone = [l for l in server.lines[start:] if "client gone" in l]
        assert len(gone) == 2, server.lines[start:]
        # The queued one is dropped as soon as its client leaves, so its line may come first.
        ran = [line for line in gone if "prompt" in line]
        assert len(ran) == 1, f"the queued request ran: {gone}"
        stopped_reply = int(ran[0].split("reply ")[1].split(" tokens")[0])
        assert 0 < stopped_reply < 400


class AccessTests:
    """CORS and the listener's limits on the real server (the API key has its own servers)."""

    def test_cors(self, server):
        """The --cors origin gets Access-Control-Allow-Origin and a preflight answer; another origin does not."""
        status, headers, _ = call("GET", server.url("/models"), headers={"Origin": ORIGIN})
        assert headers.getRawHeaders("access-control-allow-origin") == [ORIGIN]
        status, headers, _ = call("OPTIONS", server.url("/chat/completions"),
                                  headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": "content-type"})
        assert status == 204
        assert headers.getRawHeaders("access-control-allow-origin") == [ORIGIN]
        status, headers, _ = call("GET", server.url("/models"), headers={"Origin": "http://other.example"})
        assert headers.getRawHeaders("access-control-allow-origin") is None

    def test_body_and_header_limits(self, server):
        """A 9 MiB body gets 413 and a 17 KiB header 431, from the real listener; the server goes on."""
        status, _, body = post(server, "/completions", {"prompt": "a" * (9 * 1024 * 1024)})
        assert (status, body["error"]["code"]) == (413, "request_too_large")
        status, _, body = call("GET", server.url("/models"), headers={"X-Big": "a" * (17 * 1024)})
        assert status == 431
        assert call("GET", server.root_url("/health"))[0] == 200

    def test_connection_close_and_idle_socket(self, server):
        """A response says Connection: close and the server closes the socket; a silent socket stays open under 60 s."""
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        reply = read_all(sock)  # returns only because the server closes
        assert b"\r\nConnection: close\r\n" in reply
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=2)
        with pytest.raises(socket.timeout):
            silent.recv(1)
        silent.close()

    def test_request_log_lines(self, server):
        """One line per request: client, method and path, status, and token counts with t/s for completions."""
        start = len(server.lines)
        post(server, "/completions", {"prompt": "Hi", "max_tokens": 3})
        call("GET", server.url("/nope"))
        line = server.wait_for(lambda l: "POST /v1/completions 200" in l, start=start)
        assert "127.0.0.1 POST /v1/completions 200 prompt " in line
        assert "reply 3 tokens" in line and line.endswith("t/s")
        server.wait_for(lambda l: "127.0.0.1 GET /v1/nope 404" in l, start=start)


class ClientTests:
    """Real client libraries and `krafla run` against the server."""

    def test_openai_python(self, server):
        """The openai Python library: chat and completions, plain and streamed."""
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        reply = client.chat.completions.create(model="local", messages=messages, max_tokens=16)
        assert "Paris" in reply.choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(model="local", messages=messages, max_tokens=16, stream=True)
                           if chunk.choices)
        assert streamed == reply.choices[0].message.content
        completion = client.completions.create(model="local", prompt="The capital of France is", max_tokens=6)
        pieces = "".join(c.choices[0].text for c in client.completions.create(
            model="local", prompt="The capital of France is", max_tokens=6, stream=True) if c.choices)
        assert pieces == completion.choices[0].text and completion.usage.completion_tokens == 6

    def test_echo_logprobs_as_lm_eval_asks(self, server, model):
        """lm-evaluation-harness's loglikelihood request (its local-completions model: the prompt as
        token ids, echo, logprobs 1, max_tokens 1, temperature 0), sent with the openai library and read
        as lm-eval reads it: a logprob for each prompt token, the first null, then the generated
        token's. They are the numpy reference forward pass's (q4_0 weights and q8_0 activations on
        both sides); the generated token's is bitwise what a plain request reports for it; max_tokens
        0 gives the prompt alone with the same values, streamed or not, and a text prompt echoes its
        text."""
        from openai import OpenAI

        from tests.support.reference import ReferenceModel

        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        ids = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4649, 314]  # "The capital of France is Paris. The capital of France is"
        reply = client.completions.create(model="local", prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0,
                                          seed=1234)
        logprobs = reply.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(ids) + 1 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None and all(len(top) == 1 for top in logprobs.top_logprobs[1:])
        assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1
        # lm-eval's parse_logprobs: the continuation's logprobs, and whether each was the top token.
        # SmolLM2-135M's top picks: " is" after the second " France", not " capital" after " The".
        def greedy(context):
            return all(value == max(top.values()) for value, top in
                       zip(logprobs.token_logprobs[context:-1], logprobs.top_logprobs[context:-1]))

        assert greedy(11) and not greedy(8)
        reference = ReferenceModel(model.mlb, q8_activations=True).forward(ids).astype(np.float64)
        reference -= reference.max(axis=1, keepdims=True)
        reference -= np.log(np.exp(reference).sum(axis=1, keepdims=True))
        want = reference[np.arange(len(ids) - 1), ids[1:]]
        # q4_0 with SmolLM2's outlier activations: a q8_0 block may round the other way on either side
        # (test_engine.py's RealModelReferenceTests), up to 0.3 apart here; a token scored at the wrong
        # position is nats off
        np.testing.assert_allclose(logprobs.token_logprobs[1:len(ids)], want, atol=0.4)
        plain = client.completions.create(model="local", prompt=[ids], max_tokens=1, logprobs=1, temperature=0)
        assert plain.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[-1:]
        assert reply.choices[0].text.endswith(plain.choices[0].text)
        alone = client.completions.create(model="local", prompt=ids, max_tokens=0, logprobs=1, echo=True)
        assert alone.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]
        assert alone.choices[0].finish_reason == "length" and alone.usage.completion_tokens == 0
        streamed = list(client.completions.create(model="local", prompt=ids, max_tokens=0, logprobs=1, echo=True,
                                                  stream=True))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == alone.choices[0].text
        assert [v for c in streamed if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs] == alone.choices[0].logprobs.token_logprobs
        text = client.completions.create(model="local", prompt="The capital of France is", max_tokens=3, echo=True,
                                         temperature=0)
        assert text.choices[0].text.startswith("The capital of France is ")

    def test_vllm_tokenizer_endpoints_as_lm_eval_reads_them(self, server, model):
        """lm-evaluation-harness's remote tokenizer (tokenizer_backend=remote, or auto): GET
        /tokenizer_info gives the end token as spelled and the model's own Jinja template (the one its
        tokenizer file keeps), POST /tokenize with vLLM's `prompt` and `add_special_tokens` gives the
        ids the tokenizer gives, /detokenize answers with vLLM's `prompt` beside llama-server's
        `content`; the eos spelling tokenizes to the end token's id."""
        from krafla_twisted.chat import template_file
        from krafla_twisted.engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(str(model.mlt))
        status, _, raw = call("GET", server.root_url("/tokenizer_info"))
        info = json.loads(raw)
        assert status == 200 and info["eos_token"] == tokenizer.token_bytes(tokenizer.eos_id).decode()
        assert info["chat_template"] == template_file.jinja_of(str(model.mlt)) and "{%" in info["chat_template"]
        assert info["model_max_length"] > 0 and info["add_bos_token"] == tokenizer.add_bos
        text = "The capital of France is Paris."
        status, _, raw = call("POST", server.root_url("/tokenize"), {"prompt": text, "add_special_tokens": False})
        answer = json.loads(raw)
        assert answer["tokens"] == tokenizer.encode(text, add_bos=False, special=True)
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == info["model_max_length"]
        with_bos = json.loads(call("POST", server.root_url("/tokenize"), {"prompt": text})[2])["tokens"]
        assert with_bos == tokenizer.encode(text, special=True)   # vLLM's default: as the tokenizer adds them
        llama_server = json.loads(call("POST", server.root_url("/tokenize"), {"content": text})[2])["tokens"]
        assert llama_server == answer["tokens"]                   # llama-server's default: no BOS
        back = json.loads(call("POST", server.root_url("/detokenize"), {"tokens": answer["tokens"]})[2])
        assert back == {"content": text, "prompt": text}
        eos = json.loads(call("POST", server.root_url("/tokenize"), {"prompt": info["eos_token"],
                                                                      "add_special_tokens": False})[2])["tokens"]
        assert eos == [tokenizer.eos_id]

    def test_several_choices_and_prompts(self, server):
        """`n` and a batch of prompts through the openai library. Choice i of a seeded chat is the reply
        the same request gets with n 1 and seed + i (each choice is a generation of its own); a batch's
        choices are its prompts' replies in order, n for each; usage counts each prompt once and
        every reply. Streamed, each choice's chunks carry its index and join to the same texts, with
        one usage chunk after the last. A prompt of the batch too long for the context makes the
        whole request a 400, and the server goes on."""
        from openai import BadRequestError, OpenAI

        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Name a colour."}]
        options = dict(model="local", messages=messages, max_tokens=8, temperature=1.0, top_p=0.95)
        reply = client.chat.completions.create(n=3, seed=40, **options)
        assert [c.index for c in reply.choices] == [0, 1, 2]
        alone = [client.chat.completions.create(seed=40 + i, **options) for i in range(3)]
        assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
        assert len({c.message.content for c in reply.choices}) > 1, "sampled with different seeds"
        assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
        assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

        prompts = ["The capital of France is", "One, two, three,"]
        batch = client.completions.create(model="local", prompt=prompts, n=2, max_tokens=6, temperature=0)
        singles = [client.completions.create(model="local", prompt=p, max_tokens=6, temperature=0) for p in prompts]
        assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)

        status, events, _ = stream(server, "/chat/completions", dict(options, n=3, seed=40, stream=True,
                                                                     stream_options={"include_usage": True}))
        assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
        texts = ["", "", ""]
        for event in events[:-1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
        assert texts == [c.message.content for c in reply.choices]
        usages = [e["usage"] for e in events[:-1] if e.get("usage")]
        assert [u["completion_tokens"] for u in usages] == [reply.usage.completion_tokens]
        assert len({e["id"] for e in events[:-1]}) == 1

        # best_of: of three seeded candidates (each the reply a lone request with seed + i gets), the
        # one of highest mean logprob, without logprobs since none were asked for; usage bills all three
        best = client.completions.create(model="local", prompt=prompts[0], max_tokens=6, temperature=1.0, seed=9,
                                         best_of=3)
        candidates = [client.completions.create(model="local", prompt=prompts[0], max_tokens=6, temperature=1.0,
                                                seed=9 + i, logprobs=0) for i in range(3)]
        means = [np.mean(c.choices[0].logprobs.token_logprobs) for c in candidates]
        assert len({c.choices[0].text for c in candidates}) > 1
        assert best.choices[0].text == candidates[int(np.argmax(means))].choices[0].text
        assert best.choices[0].logprobs is None and len(best.choices) == 1
        assert best.usage.completion_tokens == sum(c.usage.completion_tokens for c in candidates)

        with pytest.raises(BadRequestError) as raised:
            client.completions.create(model="local", prompt=["Hi", "hello " * 5000], max_tokens=4)
        assert raised.value.code == "context_length_exceeded"
        assert client.completions.create(model="local", prompt=prompts[0], max_tokens=6,
                                         temperature=0).choices[0].text == singles[0].choices[0].text

    def test_openai_node(self, server):
        """The openai npm package under node: chat and completions, plain and streamed, models, a wrong key is fine here."""
        node_dir = os.path.join(REPO, "tests", "node")
        if not os.path.isdir(os.path.join(node_dir, "node_modules", "openai")):
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=node_dir, check=True, timeout=600)
        result = subprocess.run(["node", "client.mjs", server.base_url, "none"], cwd=node_dir, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert "Paris" in out["chat"]["content"] and out["chat"]["object"] == "chat.completion"
        assert out["chat_stream"]["content"] == out["chat"]["content"]
        assert out["chat_stream"]["usage"]["completion_tokens"] == out["chat"]["usage"]["completion_tokens"]
        assert out["completion_stream"]["text"] == out["completion"]["text"]
        assert len(out["models"]) == 1
        assert out["wrong_key"] == "accepted"  # this server has no key

    def test_docs_curl_example(self, server):
        """The curl example in docs/server.md (the original's), pointed at this server, gets a chat reply."""
        with open(os.path.join(REPO, "docs", "server.md"), encoding="utf-8") as f:
            docs = f.read()
        block = next(b for b in docs.split("```sh\n")[1:] if b.startswith("curl "))
        command = block.split("```")[0].replace("http://127.0.0.1:8080", server.root_url(""))
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
        reply = json.loads(result.stdout)
        assert reply["object"] == "chat.completion"
        assert "Paris" in reply["choices"][0]["message"]["content"]

    def test_same_reply_as_krafla_run(self, server, model):
        """A one-message chat at temperature 0 gets the reply `krafla run --chat smollm -T 0` prints."""
        krafla = os.path.join(os.path.dirname(sys.executable), "krafla")
        run = subprocess.run([krafla, "run", str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-T", "0",
                              "-n", "24", "-p", QUESTION], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        reply = post(server, "/chat/completions", chat_body(QUESTION, max_tokens=24, temperature=0))[2]
        assert run.stdout.strip() == reply["choices"][0]["message"]["content"].strip()
