"""A web page in headless Chromium (Debian's `chromium`) calling a real krafla server from another origin.

tests/web/ (a small chat page) is served by a static server on two loopback ports, two origins.
krafla runs with `--cors` for the first one only. From the allowed origin the page streams a chat
reply with fetch and a stream reader; from the other, and from the allowed one against a second
server started without `--cors`, the browser blocks the read (the CORS preflight gets no grant, so
the POST is never even sent). The page reports what happened by
POSTing to /result on its own origin, which is how the test learns it.
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import time
import urllib.parse

import pytest
from twisted.internet import reactor
from twisted.web import resource, server as web_server, static

from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess, in_reactor

WEB = os.path.join(REPO, "tests", "web")
QUESTION = "What is the capital of France?"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]


class ResultSink(resource.Resource):
    """POST /result: the page's report, handed to the test through a queue."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.results = queue.Queue()

    def render_POST(self, request):
        self.results.put(json.loads(request.content.read()))
        return b"ok"


class Origin:
    """tests/web/ on its own loopback port, with a /result sink."""

    def __init__(self):
        root = static.File(WEB)
        self.sink = ResultSink()
        root.putChild(b"result", self.sink)
        self.port = in_reactor(reactor.listenTCP, 0, web_server.Site(root), interface="127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"

    def close(self):
        in_reactor(self.port.stopListening)


def chromium():
    path = shutil.which("chromium")
    assert path, "chromium is not installed: `make tools` installs it from Debian's packages"
    return path


def open_page(origin, page_url, profile, timeout=180):
    """Load page_url in a fresh headless Chromium and return the report the page POSTs to origin's /result."""
    process = subprocess.Popen([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", page_url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return origin.sink.results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the page reported nothing within {timeout} s (chromium exit: {process.poll()})") from None
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the browser's own helper processes, in the group we made
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def origins():
    allowed, other = Origin(), Origin()
    yield allowed, other
    allowed.close()
    other.close()


@pytest.fixture(scope="module")
def server(origins):
    model = real_model("smollm2-135m")
    allowed, _ = origins
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2", "--cors", allowed.url])
    process.start()
    yield process
    process.stop()


def page(origin, server):
    query = urllib.parse.urlencode({"api": server.base_url, "message": QUESTION, "report": "1"})
    return f"{origin.url}/index.html?{query}"


class BrowserTests:
    """fetch() streaming from headless Chromium, with and without the server's CORS grant."""

    def test_allowed_origin_reads_streamed_reply(self, origins, server, tmp_path):
        """From the --cors origin the page reads the stream to `data: [DONE]` and gets the same text as a plain request."""
        allowed, _ = origins
        start = len(server.lines)
        report = open_page(allowed, page(allowed, server), tmp_path / "profile")
        assert "error" not in report, report
        assert report["status"] == 200 and report["done"] is True
        assert report["events"] >= 3 and report["reads"] >= 1
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        plain = client.chat.completions.create(model="local", messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=16, temperature=0)
        assert report["text"] == plain.choices[0].message.content
        assert "Paris" in report["text"]
        # A request's log line follows its reply: wait for both here, so that the next test's lines
        # (which must hold no POST) begin after them.
        for _ in range(2):
            line = server.wait_for(lambda l: "POST /v1/chat/completions 200" in l, start=start)
            start = server.lines.index(line, start) + 1

    def test_other_origin_is_blocked(self, origins, server, tmp_path):
        """From an origin --cors does not name, fetch rejects with a TypeError and the POST never reaches the engine."""
        _, other = origins
        start = len(server.lines)
        report = open_page(other, page(other, server), tmp_path / "profile")
        assert report.get("blocked") is True, report
        assert "text" not in report
        server.wait_for(lambda line: "OPTIONS /v1/chat/completions" in line, start=start)
        lines = server.lines[start:]
        assert any("OPTIONS /v1/chat/completions 204" in line for line in lines), lines
        assert not any("POST /v1/chat/completions" in line for line in lines), lines

    def test_server_without_cors_is_blocked(self, origins, tmp_path):
        """The same page and origin against a server started without --cors: the browser blocks the read."""
        allowed, _ = origins
        model = real_model("smollm2-135m")
        plain = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2"]).start()
        try:
            report = open_page(allowed, page(allowed, plain), tmp_path / "profile")
        finally:
            plain.stop()
        assert report.get("blocked") is True, report
        assert not any("POST /v1/chat/completions" in line for line in plain.lines), plain.lines
