"""The HTTP connection rules: body and header limits, the idle timeout, no keep-alive, one log line.

The idle timeout is HTTPFactory's, run on the reactor it is given, so a
MemoryReactorClock drives it in tests.
"""

import io

from twisted.logger import Logger
from twisted.web import http, server

from krafla_twisted.api.errors import APIError, BodyTooLarge, HeadTooLarge, InvalidRequest, LengthRequired, RequestTimeout

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024
IDLE_TIMEOUT_SECONDS = 60
# Hardening (owner: hardening): deadlines Twisted does not keep by itself.
HEAD_DEADLINE_SECONDS = 60  # the request line and headers, however slowly they trickle in (>= the idle timeout)
REQUEST_DEADLINE_SECONDS = 120  # the whole request, body included, from the moment the client connected
WRITE_DEADLINE_SECONDS = 60  # a client that reads nothing of what we send for this long is cut off
DISCARD_LIMIT_BYTES = 2 * MAX_BODY_BYTES  # refused body bytes read (so the client sees the answer) before hanging up

log = Logger(namespace="krafla.http")
_REASONS = {431: b"Request Header Fields Too Large", 408: b"Request Timeout"}


class _DiscardedBody(io.BytesIO):
    """A request body we refuse: read from the client (so the reply is not lost to a reset) but not kept.

    Reading stops after DISCARD_LIMIT_BYTES: then `on_limit` answers at once and hangs up.
    """

    def __init__(self, on_limit):
        super().__init__()
        self._left = DISCARD_LIMIT_BYTES
        self._on_limit = on_limit

    def write(self, data):
        self._left -= len(data)
        if self._left < 0 and self._on_limit is not None:
            on_limit, self._on_limit = self._on_limit, None
            on_limit()
        return len(data)


class APIRequest(server.Request):
    """A request that refuses over-large or chunked bodies and logs one line (and counts itself in
    its site's metrics, if any) when it ends.

    `body_error` is set (to an APIError) when the body was refused; the Resource tree answers with
    it. `completion_stats` (a GenerationResult) is set by completion resources for the log line.
    """

    body_error = None
    completion_stats = None
    received = False
    lost = False
    work_pending = False  # a job for this request is queued or running: a lost client is logged when it ends

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notifyFinish().addCallbacks(self._log_finished, self._log_lost)

    def gotLength(self, length):
        # This runs in the I/O thread, when the head has been read and before any body byte.
        codings = b",".join(self.requestHeaders.getRawHeaders(b"transfer-encoding") or ())
        if codings and [c.strip().lower() for c in codings.split(b",")] != [b"chunked"]:
            # Twisted reads "identity" (and the like) as no body; a proxy might not: refuse the ambiguity.
            self.body_error = InvalidRequest(f"Transfer-Encoding {codings.decode('latin-1')!r} is not accepted; send a "
                                             f"Content-Length", code="invalid_http_request")
        elif length is None:
            self.body_error = LengthRequired()
        elif length > MAX_BODY_BYTES:
            self.body_error = BodyTooLarge(MAX_BODY_BYTES)
        if self.body_error is None:
            return super().gotLength(length)
        answer = lambda: self.channel.answer_and_close(self.body_error)  # noqa: E731
        if length is not None and length > DISCARD_LIMIT_BYTES:
            answer()  # a body too large even to read through: answer now
        self.content = _DiscardedBody(on_limit=answer)

    def requestReceived(self, command, path, version):
        self.received = True
        super().requestReceived(command, path, version)

    def _describe(self):
        client = self.getClientAddress()
        host = getattr(client, "host", None) or "-"
        method = self.method.decode("ascii", "replace")
        path = self.uri.decode("ascii", "replace")
        return f"{host} {method} {path}"

    def _count(self, gone):
        metrics = getattr(getattr(self, "site", None), "metrics", None)
        if metrics is not None:
            metrics.observe(self.path, None if gone else self.code, self.completion_stats, gone=gone,
                            model=getattr(self, "model_label", None))

    def _log_finished(self, _):
        self._count(gone=False)
        line = f"{self._describe()} {self.code}"
        if self.completion_stats is not None:
            line += " " + format_stats(self.completion_stats)
        log.info("{line}", line=line)

    def _log_lost(self, _):
        if not self.received:
            return  # the head never arrived whole: nothing was asked
        self.lost = True
        if not self.work_pending:
            self._log_gone()

    def work_done(self):
        """The engine is done with this request (or skipped it): log a lost client's line now, with its counts.

        This must be called in the I/O thread.
        """
        self.work_pending = False
        if self.lost:
            self._log_gone()

    def _log_gone(self):
        self._count(gone=True)
        line = f"{self._describe()} client gone"
        if self.completion_stats is not None:
            line += " " + format_stats(self.completion_stats)
        log.info("{line}", line=line)


def format_stats(stats):
    """'prompt 25 tokens (12 cached) 310.2 t/s, reply 40 tokens 52.1 t/s' from a GenerationResult (and
    ', speculation 30/41 proposed tokens accepted' when speculation proposed any)."""
    computed = stats.prompt_tokens - stats.cached_tokens
    prompt_speed = computed / stats.prompt_seconds if stats.prompt_seconds > 0 else 0.0
    reply_speed = stats.completion_tokens / stats.generation_seconds if stats.generation_seconds > 0 else 0.0
    line = (
        f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached) {prompt_speed:.1f} t/s, "
        f"reply {stats.completion_tokens} tokens {reply_speed:.1f} t/s"
    )
    proposed = stats.proposed_tokens
    if proposed:
        line += f", speculation {stats.accepted_tokens}/{proposed} proposed tokens accepted"
    return line


class APIChannel(http.HTTPChannel):
    """HTTP/1.1 without keep-alive: every response says Connection: close and the connection ends.

    A request head (request line and headers) over 16 KiB gets 431 with an OpenAI error body.
    Deadlines Twisted does not keep: the head must arrive within HEAD_DEADLINE_SECONDS and the whole
    request within REQUEST_DEADLINE_SECONDS of connecting (a byte every few seconds does not keep a
    connection), and a client that reads nothing for WRITE_DEADLINE_SECONDS while we have bytes for
    it (a paused stream, a reply waiting to be flushed before the close) is cut off.
    """

    totalHeadersSize = MAX_HEADER_BYTES
    MAX_LENGTH = MAX_HEADER_BYTES
    _head_bytes = 0
    _head_done = False
    _closing = False  # answered outside the Request (a refusal or a deadline): read nothing more
    _losing = False  # loseConnection was called: the connection ends once its buffer is sent
    _head_call = _request_call = _write_call = None

    def connectionMade(self):
        super().connectionMade()
        self._head_call = self.callLater(HEAD_DEADLINE_SECONDS, self._too_slow)
        self._request_call = self.callLater(REQUEST_DEADLINE_SECONDS, self._too_slow)
        channels = getattr(self.factory, "channels", None)
        if channels is not None:
            channels.add(self)

    def dataReceived(self, data):
        if self._closing or self._losing:
            return  # answered and closing: a real transport stops reading too, but bytes may be in flight
        super().dataReceived(data)

    def lineReceived(self, line):
        if not self._head_done:
            self._head_bytes += len(line) + len(self.delimiter)
            if self._head_bytes > MAX_HEADER_BYTES:
                return self._refuse_head()
        return super().lineReceived(line)

    def lineLengthExceeded(self, line):
        return self._refuse_head()

    def allHeadersReceived(self):
        self._head_done = True
        self._cancel("_head_call")
        super().allHeadersReceived()

    def allContentReceived(self):
        self._cancel("_request_call")
        if self._closing:
            return  # answered already (a refused body that ended in the same read): no second answer
        super().allContentReceived()

    def _refuse_head(self):
        self.answer_and_close(HeadTooLarge(MAX_HEADER_BYTES))

    def _respondToBadRequestAndDisconnect(self):
        # Twisted's answer to a malformed request line, header or framing has no body: give it the API's.
        self.answer_and_close(InvalidRequest("The request is not valid HTTP/1.1: its request line, a header, or its "
                                             "framing (Content-Length, Transfer-Encoding) is malformed or ambiguous",
                                             code="invalid_http_request"))

    def _send100Continue(self):
        # "Expect: 100-continue" on a body we refuse: say no now instead of inviting the body.
        error = getattr(self.requests[-1], "body_error", None) if self.requests else None
        if error is not None:
            return self.answer_and_close(error)
        if not self._closing:
            super()._send100Continue()

    def _too_slow(self):
        self._head_call = self._request_call = None
        self.answer_and_close(RequestTimeout(HEAD_DEADLINE_SECONDS if not self._head_done else REQUEST_DEADLINE_SECONDS))

    def answer_and_close(self, error: APIError):
        """Answer `error` outside any Request (the request is not whole), then close the connection."""
        if self._closing or self._losing or self.transport is None:
            return
        self._closing = True
        self._cancel("_head_call")
        self._cancel("_request_call")
        body = error.json_bytes()
        reason = _REASONS.get(error.status) or http.RESPONSES.get(error.status, b"Error")
        head = [b"HTTP/1.1 %d %s" % (error.status, reason), b"Content-Type: application/json", b"Connection: close",
                b"Content-Length: " + str(len(body)).encode("ascii")]
        head += [name + b": " + value for name, value in error.headers]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        peer = getattr(self.transport.getPeer(), "host", "-")
        log.info("{line}", line=f"{peer} {error.status} {error.message}")
        self.loseConnection()

    def loseConnection(self):
        # What is still buffered must reach a reading client; a client that reads nothing is cut off.
        if self._losing:
            return
        self._losing = True
        self.setTimeout(None)
        self._cancel("_head_call")
        self._cancel("_request_call")
        self._start_write_deadline()
        super().loseConnection()

    def pauseProducing(self):
        # The transport's buffer is full: the client is not reading what we send.
        self._start_write_deadline()
        super().pauseProducing()

    def resumeProducing(self):
        self._cancel("_write_call")
        super().resumeProducing()

    def _start_write_deadline(self):
        if self._write_call is None and self.transport is not None:
            self._write_call = self.callLater(WRITE_DEADLINE_SECONDS, self._not_reading)

    def _not_reading(self):
        self._write_call = None
        peer = getattr(self.transport.getPeer(), "host", "-")
        log.info("{line}", line=f"{peer} cut off: read nothing for {WRITE_DEADLINE_SECONDS} s")
        self.transport.abortConnection()

    def _cancel(self, name):
        call = getattr(self, name)
        if call is not None:
            setattr(self, name, None)
            if call.active():
                call.cancel()

    def connectionLost(self, reason):
        for name in ("_head_call", "_request_call", "_write_call"):
            self._cancel(name)
        super().connectionLost(reason)
        channels = getattr(self.factory, "channels", None)
        if channels is not None:
            channels.discard(self)
            if not channels:
                self.factory.all_closed()

    def checkPersistence(self, request, version):
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        return False

    @property
    def idle(self):
        """No request is being handled (nothing received yet, or only part of a head or body)."""
        return not self._handlingRequest


class APISite(server.Site):
    """The Site for the API: our Request and Channel, the idle timeout on the given reactor; with
    `metrics` (an api.metrics.Metrics), every request is counted when its log line is written."""

    requestFactory = APIRequest
    protocol = APIChannel

    def __init__(self, resource, reactor, metrics=None):
        super().__init__(resource, timeout=IDLE_TIMEOUT_SECONDS, reactor=reactor)
        self.metrics = metrics
        self.displayTracebacks = False
        self.noisy = False
        self.channels = set()  # open connections, for a shutdown that lets replies reach their clients
        self._closed_waiters = []

    def close_connections(self, timeout):
        """At shutdown: close connections that are not being answered; the Deferred fires when every
        connection is gone, or after `timeout` seconds (those left are aborted)."""
        from twisted.internet import defer

        for channel in list(self.channels):
            if channel.idle:
                channel.transport.loseConnection()
        if not self.channels:
            return defer.succeed(None)
        d = defer.Deferred()
        self._closed_waiters.append(d)

        def give_up():
            for channel in list(self.channels):
                channel.transport.abortConnection()
            self.all_closed()

        call = self.reactor.callLater(timeout, give_up)
        d.addBoth(lambda result: (call.cancel() if call.active() else None, result)[1])
        return d

    def all_closed(self):
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(None)

    def log(self, request):
        """Replaced by APIRequest's own line, which also covers requests whose client left."""
