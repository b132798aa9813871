"""Server-sent events (or newline-delimited JSON) through a push producer.

The transport tells the HTTP channel to pause when its write buffer is full (a client that reads
slowly); the channel passes that on to the registered producer, this one. While paused, events wait
here instead of piling up in the transport; resumeProducing writes them. The events of one reply
are bounded by the context length, so holding them is bounded too.
"""

import json

from zope.interface import implementer
from twisted.internet.interfaces import IPushProducer

DONE = b"data: [DONE]\n\n"


def _json(payload):
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def event(payload, name=None):
    """One SSE event carrying a JSON object (compact, one line: JSON has no raw newlines), after an
    `event: NAME` line when it has a name (Anthropic's and the Responses API's typed events)."""
    head = b"event: " + name.encode("ascii") + b"\n" if name is not None else b""
    return head + b"data: " + _json(payload) + b"\n\n"


@implementer(IPushProducer)
class EventStream:
    """The event stream of one response. Every method must be called in the I/O thread.

    `on_stop` is called once if the connection goes before the stream ended. `done`: the stream ends
    with `data: [DONE]` (OpenAI's Chat Completions); `ndjson`: one JSON object per line instead of
    SSE events (Ollama's streams).
    """

    def __init__(self, request, on_stop=lambda: None, *, done=True, ndjson=False):
        self.request = request
        self.done = done and not ndjson
        self.ndjson = ndjson
        self.started = False
        self.paused = False
        self._frames = []
        self._ending = False
        self._on_stop = on_stop

    def start(self):
        """Send the response head; from here on an error can only travel as an event."""
        if self.started or self.request is None:
            return
        self.started = True
        self.request.setResponseCode(200)
        content_type = b"application/x-ndjson" if self.ndjson else b"text/event-stream; charset=utf-8"
        self.request.setHeader(b"content-type", content_type)
        self.request.setHeader(b"cache-control", b"no-cache")
        self.request.setHeader(b"x-accel-buffering", b"no")
        self.request.registerProducer(self, True)

    def send(self, payload, name=None):
        """Queue one event (one line in ndjson); `name` is the SSE event's type, if it has one."""
        self.start()
        self._frames.append(_json(payload) + b"\n" if self.ndjson else event(payload, name))
        self._flush()

    def end(self):
        """Send `data: [DONE]` (with `done`) after everything queued, then finish the response."""
        self.start()
        if self.done:
            self._frames.append(DONE)
        self._ending = True
        self._flush()

    def _flush(self):
        # request.write may re-enter pauseProducing or stopProducing; both are checked every turn.
        while self.request is not None and not self.paused and self._frames:
            self.request.write(self._frames.pop(0))
        if self._ending and not self._frames and self.request is not None:
            request, self.request = self.request, None
            request.unregisterProducer()
            request.finish()

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        if self.request is None:
            return
        self.paused = False
        self._flush()

    def stopProducing(self):
        if self.request is None:
            return
        self.request = None
        self._frames.clear()
        self._on_stop()
