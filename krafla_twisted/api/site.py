"""The HTTP connection rules: body and header limits, the idle timeout, no keep-alive, one log line.

The idle timeout is HTTPFactory's, run on the reactor it is given, so a
MemoryReactorClock drives it in tests.
"""

import io

from twisted.logger import Logger
from twisted.web import http, server

from krafla_twisted.api.errors import BodyTooLarge, HeadTooLarge, LengthRequired

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024
IDLE_TIMEOUT_SECONDS = 60

log = Logger(namespace="krafla.http")


class _DiscardedBody(io.BytesIO):
    """A request body we refuse: read from the client (so the reply is not lost to a reset) but not kept."""

    def write(self, data):
        return len(data)


class APIRequest(server.Request):
    """A request that refuses over-large or chunked bodies and logs one line when it ends.

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
        if length is None:
            self.body_error = LengthRequired()
        elif length > MAX_BODY_BYTES:
            self.body_error = BodyTooLarge(MAX_BODY_BYTES)
        if self.body_error is not None:
            self.content = _DiscardedBody()
        else:
            super().gotLength(length)

    def requestReceived(self, command, path, version):
        self.received = True
        super().requestReceived(command, path, version)

    def _describe(self):
        client = self.getClientAddress()
        host = getattr(client, "host", None) or "-"
        method = self.method.decode("ascii", "replace")
        path = self.uri.decode("ascii", "replace")
        return f"{host} {method} {path}"

    def _log_finished(self, _):
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
        line = f"{self._describe()} client gone"
        if self.completion_stats is not None:
            line += " " + format_stats(self.completion_stats)
        log.info("{line}", line=line)


def format_stats(stats):
    """'prompt 25 tokens (12 cached) 310.2 t/s, reply 40 tokens 52.1 t/s' from a GenerationResult."""
    computed = stats.prompt_tokens - stats.cached_tokens
    prompt_speed = computed / stats.prompt_seconds if stats.prompt_seconds > 0 else 0.0
    reply_speed = stats.completion_tokens / stats.generation_seconds if stats.generation_seconds > 0 else 0.0
    return (
        f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached) {prompt_speed:.1f} t/s, "
        f"reply {stats.completion_tokens} tokens {reply_speed:.1f} t/s"
    )


class APIChannel(http.HTTPChannel):
    """HTTP/1.1 without keep-alive: every response says Connection: close and the connection ends.

    A request head (request line and headers) over 16 KiB gets 431 with an OpenAI error body.
    """

    totalHeadersSize = MAX_HEADER_BYTES
    MAX_LENGTH = MAX_HEADER_BYTES
    _head_bytes = 0
    _head_done = False

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
        super().allHeadersReceived()

    def _refuse_head(self):
        body = HeadTooLarge(MAX_HEADER_BYTES).json_bytes()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode("ascii") + b"\r\n\r\n" + body
        )
        self.transport.loseConnection()

    def checkPersistence(self, request, version):
        request.responseHeaders.setRawHeaders(b"connection", [b"close"])
        return False


class APISite(server.Site):
    """The Site for the API: our Request and Channel, the idle timeout on the given reactor."""

    requestFactory = APIRequest
    protocol = APIChannel

    def __init__(self, resource, reactor):
        super().__init__(resource, timeout=IDLE_TIMEOUT_SECONDS, reactor=reactor)
        self.displayTracebacks = False
        self.noisy = False

    def log(self, request):
        """Replaced by APIRequest's own line, which also covers requests whose client left."""
