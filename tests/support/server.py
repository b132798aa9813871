"""A real `twistd krafla` process for integration tests, and a reactor thread to drive treq from pytest.

    server = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat]).start()
    server.url("/chat/completions")      # http://127.0.0.1:PORT/v1/chat/completions
    in_reactor(treq.get, server.url("/models"))   # runs in the reactor thread, waits for the result
    server.stop()                        # SIGTERM, then the exit status

The port is 0 and read from the `# listening on http://HOST:PORT/v1` line, so tests never collide.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

from twisted.internet import reactor as _global_reactor
from twisted.internet import threads

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
LISTENING = re.compile(r"# listening on (http://(\S+?):(\d+)/v1)")
START_TIMEOUT = float(os.environ.get("KRAFLA_TEST_START_TIMEOUT", "300"))

_reactor_thread = None
_reactor_lock = threading.Lock()


def in_reactor(function, *args, **kwargs):
    """Call function in the reactor thread and wait for its result (Deferreds are waited for)."""
    global _reactor_thread
    with _reactor_lock:
        if _reactor_thread is None:
            _reactor_thread = threading.Thread(
                target=_global_reactor.run, kwargs={"installSignalHandlers": False}, name="test-reactor", daemon=True
            )
            _reactor_thread.start()
    return threads.blockingCallFromThread(_global_reactor, function, *args, **kwargs)


def treq_call(method, url, body=None, headers=None):
    """(status, headers, body bytes) of one request made with treq in the reactor thread.

    `body` is bytes, or anything JSON-encodable (sent as application/json).
    """
    import json

    import treq
    from twisted.internet import defer

    @defer.inlineCallbacks
    def go():
        kwargs = {"headers": dict(headers or {})}
        if body is not None:
            kwargs["data"] = body if isinstance(body, bytes) else json.dumps(body).encode()
            kwargs["headers"].setdefault("Content-Type", "application/json")
        response = yield treq.request(method, url, persistent=False, **kwargs)
        content = yield response.content()
        return response.code, response.headers, content

    return in_reactor(go)


def server_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KRAFLA_API_KEY", None)
    env.update(extra or {})
    return env


def wait_for_log(logfile, pattern, timeout=300):
    """The first match of `pattern` (a compiled regex) in a daemonized server's log file, read again
    until it appears (a daemon's only output is that file); fails after `timeout` seconds with the log
    so far."""
    deadline = time.monotonic() + timeout
    match = None
    while match is None and time.monotonic() < deadline:
        match = pattern.search(logfile.read_text()) if logfile.exists() else None
        time.sleep(0.2)
    assert match, logfile.read_text() if logfile.exists() else f"{logfile} was never written"
    return match


def wait_for_listening(logfile, timeout=300):
    """The LISTENING match in a daemonized server's log file (wait_for_log)."""
    return wait_for_log(logfile, LISTENING, timeout)


def queue_line(pending):
    """The --log-queue line saying `pending` requests are queued or running."""
    return f"queue: {pending} pending"



def wait_until_removed(path, timeout=60):
    """Poll until `path` is gone (a daemon removes its pidfile on exit); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists(), f"{path} still exists after {timeout} s"


class ServerProcess:
    """One `twistd -n krafla ARGS --port 0` child; its stdout (the log) is collected line by line."""

    def __init__(self, args, env=None, twistd_args=()):
        self.args = list(args)
        self.env = server_env(env)
        self.twistd_args = list(twistd_args)
        self.process = None
        self.lines = []
        self._eof = False
        self._changed = threading.Condition()
        self.base_url = None
        self.port = None

    def start(self, timeout=START_TIMEOUT):
        # --pidfile= : no twistd.pid in the working directory, so servers can run side by side.
        command = [TWISTD, "-n", "--pidfile=", *self.twistd_args, "krafla", *self.args, "--port", "0"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, text=True,
            encoding="utf-8", errors="replace",
        )
        threading.Thread(target=self._read, daemon=True, name="server-log").start()
        line = self.wait_for(LISTENING.search, timeout)
        match = LISTENING.search(line)
        self.base_url, self.port = match.group(1), int(match.group(3))
        return self

    def _read(self):
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    def wait_for(self, predicate, timeout=60, start=0):
        """The first log line from index `start` on for which predicate(line) is true; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[start:]:
                    if predicate(line):
                        return line
                if self._eof:
                    raise AssertionError(f"server exited with {self.process.returncode}:\n" + "\n".join(self.lines))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError("timed out waiting for the server log; it says:\n" + "\n".join(self.lines[-40:]))
                self._changed.wait(min(remaining, 0.5))

    def url(self, path):
        """The URL of `path` under /v1 (path starts with /)."""
        return self.base_url + path

    def root_url(self, path):
        return self.base_url[: -len("/v1")] + path

    def stop(self, timeout=60):
        """SIGTERM and wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        # The log reader may still hold the last lines: wait until it has read to the end.
        with self._changed:
            self._changed.wait_for(lambda: self._eof, timeout=10)
        return self.process.returncode
