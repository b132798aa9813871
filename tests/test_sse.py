"""api/sse.py's EventStream, alone: the framing each API's stream needs (OpenAI's data events and
[DONE], named events for Anthropic's and the Responses API, newline-delimited JSON for Ollama's),
and the push producer holding events while the client reads slowly."""

import json

from krafla_twisted.api.sse import EventStream


class Request:
    """What EventStream uses of a twisted.web request: the head, write, the producer and finish."""

    def __init__(self):
        self.code, self.headers, self.written, self.producer, self.finished = None, {}, [], None, False

    def setResponseCode(self, code):
        self.code = code

    def setHeader(self, name, value):
        self.headers[name] = value

    def registerProducer(self, producer, streaming):
        assert streaming and self.producer is None
        self.producer = producer

    def unregisterProducer(self):
        self.producer = None

    def write(self, data):
        assert not self.finished
        self.written.append(data)

    def finish(self):
        self.finished = True


def events(body):
    """[(name or None, payload or "[DONE]")] of an SSE body, read by the SSE rules (fields per line,
    a blank line ends an event)."""
    out = []
    for block in body.decode("utf-8").split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        data = fields["data"]
        out.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return out


def run(stream, sends):
    request = stream.request
    for payload, name in sends:
        stream.send(payload, name)
    stream.end()
    return request, b"".join(request.written)


class EventStreamTests:
    def test_openai_data_events_end_with_done(self):
        request, body = run(EventStream(Request()), [({"a": 1}, None), ({"b": "é\n"}, None)])
        assert request.headers[b"content-type"] == b"text/event-stream; charset=utf-8"
        assert events(body) == [(None, {"a": 1}), (None, {"b": "é\n"}), (None, "[DONE]")]
        assert request.finished and request.producer is None

    def test_named_events_without_done(self):
        _, body = run(EventStream(Request(), done=False),
                      [({"type": "message_start"}, "message_start"), ({"type": "ping"}, "ping")])
        assert events(body) == [("message_start", {"type": "message_start"}), ("ping", {"type": "ping"})]

    def test_ndjson_is_one_object_per_line(self):
        request, body = run(EventStream(Request(), ndjson=True), [({"done": False}, None), ({"done": True}, None)])
        assert request.headers[b"content-type"] == b"application/x-ndjson"
        assert [json.loads(line) for line in body.decode().splitlines()] == [{"done": False}, {"done": True}]
        assert body.endswith(b"\n") and b"[DONE]" not in body

    def test_paused_events_wait_and_keep_their_order(self):
        request = Request()
        stream = EventStream(request, ndjson=True)
        stream.start()
        stream.pauseProducing()
        stream.send({"n": 1})
        stream.send({"n": 2})
        assert request.written == []
        stream.resumeProducing()
        stream.end()
        assert [json.loads(line)["n"] for line in b"".join(request.written).decode().splitlines()] == [1, 2]
