"""The chat page at `/` (krafla_twisted/api/page.py, krafla_twisted/api/web/), in Debian's headless
Chromium driven by Playwright, against a real `twistd krafla` serving SmolLM2-135M.

What the page shows is checked against the server's own API called by the openai library: at
temperature 0 the streamed reply the page keeps is the non-streamed reply's text; a stopped reply
is a prefix of the reply the server logs as cut off; the code block shown is the fence of the
model's reply; HTML the model writes is shown as text. Waits are Playwright's (a selector, a
function, a request), never fixed sleeps.

KRAFLA_SCREENSHOTS=docs/images writes the screenshots docs/server.md shows.
"""

import distutils.core
import html.parser
import http.client
import json
import os
import re
import urllib.parse

import pytest
from playwright import sync_api as playwright_api

from krafla_twisted.api.page import CONTENT_SECURITY_POLICY, PAGE_FILES, load_page_files
from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess
from tests.test_browser import CHROMIUM_FLAGS, chromium

SCREENSHOTS = os.environ.get("KRAFLA_SCREENSHOTS")
LAST_REPLY = "#messages .message.assistant:last-child"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant. Answer briefly."
KEY = "page-test-key"
WAIT_MS = 120_000  # a reply on a busy 2-core machine


def smollm2_args():
    model = real_model("smollm2-135m")
    return [str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2"]


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(smollm2_args()).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium(), headless=True,
                                              args=[flag for flag in CHROMIUM_FLAGS if flag != "--headless"])
        yield launched
        launched.close()


class Tab:
    """One page in a fresh browser context (its own localStorage), with what it logged and requested."""

    def __init__(self, browser, url):
        self.context = browser.new_context(viewport={"width": 1200, "height": 760})
        self.page = self.context.new_page()
        self.origin = url.rstrip("/")
        self.errors = []
        self.requests = []
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("request", lambda request: self.requests.append(request))
        self.page.set_default_timeout(WAIT_MS)
        self.page.goto(url)

    def wait_for_models(self):
        self.page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")

    def settings(self, **fields):
        """Fill the settings panel: system, temperature, top_p, max_tokens, seed."""
        if self.page.is_hidden("#settings"):
            self.page.click("#toggle-settings")
        ids = {"system": "#system", "temperature": "#temperature", "top_p": "#top-p", "max_tokens": "#max-tokens",
               "seed": "#seed"}
        for name, value in fields.items():
            self.page.fill(ids[name], str(value))

    def send(self, text):
        self.page.fill("#prompt", text)
        self.page.click("#send")

    def wait_for_reply(self, state="done"):
        self.page.wait_for_selector(f'{LAST_REPLY}[data-state="{state}"]', state="attached")
        return self.page.locator(LAST_REPLY)

    def conversations(self):
        return self.page.evaluate("() => JSON.parse(localStorage.getItem('krafla.conversations') || '[]')")

    def current(self):
        current = self.page.evaluate("() => JSON.parse(localStorage.getItem('krafla.current'))")
        return next(c for c in self.conversations() if c["id"] == current)

    def screenshot(self, name):
        if SCREENSHOTS:
            directory = os.path.join(REPO, SCREENSHOTS)
            os.makedirs(directory, exist_ok=True)
            self.page.screenshot(path=os.path.join(directory, name))

    def outside_requests(self):
        return [r.url for r in self.requests if not r.url.startswith(self.origin + "/") and not r.url.startswith("data:")]

    def close(self, expected_errors=()):
        """Close the tab; the page must have logged no error (a CSP refusal is one) beyond `expected_errors`."""
        unexpected = [e for e in self.errors if not any(pattern in e for pattern in expected_errors)]
        self.context.close()
        assert unexpected == [], unexpected


@pytest.fixture
def tab(browser, server):
    opened = Tab(browser, server.root_url("/"))
    yield opened
    opened.close()


def plain_reply(server, messages, key="none", **fields):
    """The server's non-streamed chat reply (the openai library's ChatCompletion)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    return client.chat.completions.create(model="local", messages=messages, **fields)


def raw_get(server, path, headers=None):
    """(status, headers, body) of GET `path` sent exactly as written (no client-side normalising)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


class ChatPageServingTests:
    """The files behind the page: how they are served and that the package ships them."""

    def test_files_served_with_their_headers(self, server):
        """/ and /ui/NAME carry their content type, the strict CSP, nosniff and an ETag (a 304 when it
        matches); /ui, directories and escapes out of web/ are 404; /health and /v1/models are as before."""
        status, headers, body = raw_get(server, "/")
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert body == open(os.path.join(REPO, "krafla_twisted", "api", "web", "index.html"), "rb").read()
        assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY.decode()
        assert "default-src 'self'" in headers["content-security-policy"]
        assert "unsafe-" not in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-cache"
        assert raw_get(server, "/", {"If-None-Match": headers["etag"]})[:1] == (304,)
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("HEAD", "/")
        head = connection.getresponse()
        assert (head.status, head.getheader("content-type"), head.read()) == (200, "text/html; charset=utf-8", b"")
        connection.close()
        types = {"app.js": "text/javascript; charset=utf-8", "markdown.js": "text/javascript; charset=utf-8",
                 "style.css": "text/css; charset=utf-8"}
        for name, content_type in types.items():
            status, headers, body = raw_get(server, "/ui/" + name)
            assert (status, headers["content-type"]) == (200, content_type), name
            assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY.decode()
        assert set(types) | {"index.html"} == set(PAGE_FILES)
        for path in ("/ui", "/ui/", "/ui/index.html", "/ui/../routes.py", "/ui/..%2fpage.py", "/ui/%2e%2e/page.py",
                     "/ui/app.js/", "/ui//app.js", "/index.html", "//ui/app.js", "/ui/web", "/ui/%2fetc%2fpasswd"):
            status, _, body = raw_get(server, path)
            assert status == 404, path
            assert "Invalid URL" in json.loads(body)["error"]["message"], path
        assert raw_get(server, "/health")[::2] == (200, b'{"status": "ok"}')
        status, _, body = raw_get(server, "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["object"] == "model"

    def test_no_inline_code_and_no_html_parsing(self):
        """index.html has no inline script, style or event handler (the CSP would refuse them), and the
        scripts never hand a string to the HTML parser or to eval: replies reach the page as text nodes."""

        class Inline(html.parser.HTMLParser):
            def __init__(self):
                super().__init__()
                self.found = []

            def handle_starttag(self, tag, attrs):
                names = {name for name, _ in attrs}
                if tag == "style" or "style" in names or any(name.startswith("on") for name in names):
                    self.found.append((tag, attrs))
                if tag == "script" and "src" not in names:
                    self.found.append((tag, attrs))

        web = os.path.join(REPO, "krafla_twisted", "api", "web")
        parser = Inline()
        parser.feed(open(os.path.join(web, "index.html")).read())
        assert parser.found == []
        for name in ("app.js", "markdown.js"):
            script = open(os.path.join(web, name)).read()
            for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                         "DOMParser", "createContextualFragment", "setAttribute(\"style"):
                assert sink not in script, (name, sink)

    def test_package_data_ships_the_page(self):
        """setup.py's build_py (what `pip install .` and a wheel copy) takes every file of web/, and
        MANIFEST.in puts them in an sdist."""
        dist = distutils.core.run_setup(os.path.join(REPO, "setup.py"), stop_after="init")
        build_py = dist.get_command_obj("build_py")
        build_py.ensure_finalized()
        shipped = {name for package, _, _, names in build_py.data_files if package == "krafla_twisted.api" for name in names}
        assert shipped == {"web/" + name for name in PAGE_FILES}
        assert set(os.listdir(os.path.join(REPO, "krafla_twisted", "api", "web"))) == set(PAGE_FILES)
        manifest = open(os.path.join(REPO, "MANIFEST.in")).read()
        assert "recursive-include krafla_twisted/api/web *.html *.css *.js" in manifest

    def test_missing_file_is_named(self, tmp_path):
        """An install without the page's files fails at start with the missing file's path, not with a 500 later."""
        for name in PAGE_FILES[:-1]:
            (tmp_path / name).write_text("x")
        with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / PAGE_FILES[-1])) + ".*package_data"):
            load_page_files(str(tmp_path))


class ChatPageBrowserTests:
    """The page in headless Chromium against the real server."""

    def test_streamed_reply_equals_plain_reply(self, tab, server):
        """The page streams the reply (the text grows while the reply is marked streaming), sends the
        settings as request fields, and keeps exactly the text of the non-streamed reply at temperature 0;
        its speed line counts the reply's tokens."""
        tab.wait_for_models()
        tab.settings(system=SYSTEM, temperature=0, top_p=0.9, max_tokens=24, seed=7)
        with tab.page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
            tab.send(QUESTION)
        body = sent.value.post_data_json
        assert body["messages"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        assert {k: body[k] for k in ("temperature", "top_p", "max_tokens", "seed", "stream")} == \
            {"temperature": 0, "top_p": 0.9, "max_tokens": 24, "seed": 7, "stream": True}
        assert body["model"] == tab.page.input_value("#model")
        # Seen mid-stream: some text shown while the reply is still marked streaming.
        tab.page.wait_for_function(f"""() => {{
            const reply = document.querySelector('{LAST_REPLY}');
            return reply && reply.dataset.state === 'streaming' && reply.querySelector('.content').textContent.length > 0;
        }}""", polling="raf")
        reply = tab.wait_for_reply()
        plain = plain_reply(server, body["messages"], temperature=0, top_p=0.9, max_tokens=24, seed=7)
        stored = tab.current()["messages"][-1]
        assert stored["content"] == plain.choices[0].message.content
        # The reply is one plain sentence (no Markdown), so what is shown is its text as it is.
        assert reply.locator(".content").inner_text() == plain.choices[0].message.content.strip()
        assert "Paris" in stored["content"]
        meta = reply.locator(".meta").inner_text()
        match = re.search(r"(\d+) tokens · ([\d.]+) tokens/s · first token ([\d.]+) s", meta)
        assert match, meta
        assert int(match.group(1)) == plain.usage.completion_tokens and float(match.group(2)) > 0
        tab.screenshot("chat-page-settings.png")

    def test_stop_cancels_the_generation(self, tab, server):
        """Stop aborts the fetch: the server logs the request as ended by the client well before its
        max_tokens, the page keeps the partial text, and that text begins the reply the server cut off."""
        tab.wait_for_models()
        tab.settings(temperature=0, max_tokens=1500)
        start = len(server.lines)
        story = "Tell me a very long story about a dragon who learns to bake bread."
        tab.send(story)
        tab.page.wait_for_function(f"() => document.querySelector('{LAST_REPLY} .content').textContent.length > 40")
        tab.page.click("#stop")
        reply = tab.wait_for_reply("stopped")
        line = server.wait_for(lambda l: "POST /v1/chat/completions client gone" in l, start=start)
        generated = int(re.search(r"reply (\d+) tokens", line).group(1))
        assert generated < 1500, line
        partial = tab.current()["messages"][-1]["content"]
        assert len(partial) > 40 and reply.locator(".meta").inner_text().startswith("stopped")
        assert tab.page.is_visible("#send") and tab.page.is_hidden("#stop")
        cut_off = plain_reply(server, [{"role": "user", "content": story}], temperature=0, max_tokens=generated)
        assert cut_off.choices[0].message.content.startswith(partial)

    def test_model_picker(self, tab, server):
        """The picker lists /v1/models' ids (here one; test_switch_between_two_models serves two)."""
        tab.wait_for_models()
        listed = json.loads(raw_get(server, "/v1/models")[2])["data"]
        options = tab.page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
        assert options == [model["id"] for model in listed]

    def test_reload_keeps_the_conversations(self, tab):
        """Chats live in localStorage (the second sent with the Enter key): after a reload both chats are
        listed and the current one shown;
        the other opens with its messages; a deleted chat stays deleted."""
        tab.wait_for_models()
        tab.settings(temperature=0, max_tokens=6)
        tab.send(QUESTION)
        first_reply = tab.wait_for_reply().locator(".content").inner_text()
        tab.page.click("#new-chat")
        tab.page.fill("#prompt", "Name a colour.")
        tab.page.press("#prompt", "Enter")  # Enter sends (Shift+Enter would be a new line)
        tab.wait_for_reply()
        tab.page.reload()
        tab.wait_for_models()
        titles = tab.page.eval_on_selector_all("#conversations .open-chat", "items => items.map(i => i.textContent)")
        assert titles == ["Name a colour.", QUESTION]  # the latest first
        assert tab.page.inner_text("#messages .message.user .content") == "Name a colour."
        assert tab.page.input_value("#max-tokens") == "6"  # the settings are kept too
        tab.page.click(f"#conversations .open-chat >> text={QUESTION}")
        assert tab.page.inner_text("#messages .message.user .content") == QUESTION
        assert tab.page.inner_text(f"{LAST_REPLY} .content") == first_reply
        tab.page.click("#conversations li.current .delete-chat")
        tab.page.reload()
        tab.wait_for_models()
        titles = tab.page.eval_on_selector_all("#conversations .open-chat", "items => items.map(i => i.textContent)")
        assert titles == ["Name a colour."]
        assert [c["messages"][0]["content"] for c in tab.conversations()] == ["Name a colour."]

    def test_code_block_from_the_model(self, tab, server):
        """A reply with a fenced block shows it as a code block whose text is the fence's content in the
        non-streamed reply, labelled with its language; Copy puts that text on the clipboard."""
        tab.wait_for_models()
        tab.settings(temperature=0, max_tokens=60)
        prompt = "Write a Python function that adds two numbers."
        tab.send(prompt)
        reply = tab.wait_for_reply()
        content = plain_reply(server, [{"role": "user", "content": prompt}], temperature=0, max_tokens=60) \
            .choices[0].message.content
        fence = re.search(r"```(\w*)\n(.*?)(?:\n```|\Z)", content, re.S)
        assert fence, content
        assert reply.locator(".code-block code").text_content() == fence.group(2)
        assert reply.locator(".code-language").text_content() == fence.group(1)
        tab.screenshot("chat-page.png")
        tab.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=tab.origin)
        reply.locator(".copy-code").click()
        tab.page.wait_for_function("() => document.querySelector('.copy-code').textContent === 'Copied'")
        assert tab.page.evaluate("() => navigator.clipboard.readText()") == fence.group(2)

    def test_html_from_the_model_is_text(self, tab, server):
        """The model asked for an HTML page answers raw HTML (a <script src=...> included): the page shows
        those characters, makes no element of them, and fetches nothing from outside."""
        tab.wait_for_models()
        tab.settings(temperature=0, max_tokens=40)
        prompt = "Write a short HTML page with a script tag that shows an alert."
        tab.send(prompt)
        reply = tab.wait_for_reply()
        content = plain_reply(server, [{"role": "user", "content": prompt}], temperature=0, max_tokens=40) \
            .choices[0].message.content
        assert "<script" in content and "<h1>" in content, content  # what this test relies on the model writing
        assert reply.locator(".content").inner_text() == content.strip()
        assert reply.locator(".content script, .content h1, .content body, .content html").count() == 0
        assert tab.outside_requests() == []

    def test_markdown_and_escaping(self, tab):
        """A stored reply with Markdown and hostile HTML: headings, emphasis, code, lists (nested),
        quotes, tables and code blocks become elements; tags and event handlers stay text, a
        javascript: link is no link, and nothing runs."""
        tab.wait_for_models()
        hostile = "\n".join([
            "## Heading",
            "Some **bold**, *em*, `code <b>`, ~~gone~~, a [link](https://example.com/a_b) and [bad](javascript:window.pwned=1).",
            '<img src=x onerror="window.pwned=2"> <script>window.pwned=3</script> snake_case_name',
            "",
            "- one",
            "- two",
            "  - nested",
            "",
            "1. first",
            "2. second",
            "",
            "> quoted",
            "",
            "| a | b |",
            "|---|:-:|",
            "| 1 | 2 |",
            "",
            "```python",
            'print("<tag>")',
            "```",
        ])
        stored = [{"id": "seeded", "created": 1, "updated": 1, "messages": [
            {"role": "user", "content": "<b>not bold</b>"},
            {"role": "assistant", "content": hostile, "state": "done"}]}]
        tab.page.evaluate("""stored => {
            localStorage.setItem('krafla.conversations', JSON.stringify(stored));
            localStorage.setItem('krafla.current', JSON.stringify('seeded'));
        }""", stored)
        tab.page.reload()
        tab.page.wait_for_selector(LAST_REPLY + " h2")
        content = tab.page.locator(LAST_REPLY + " .content")
        texts = lambda selector: content.locator(selector).all_text_contents()  # noqa: E731
        assert texts("h2") == ["Heading"] and texts("strong") == ["bold"] and texts("em") == ["em"]
        assert texts("p code") == ["code <b>"] and texts("del") == ["gone"]
        assert content.locator("a").evaluate_all("links => links.map(a => [a.href, a.textContent])") == \
            [["https://example.com/a_b", "link"]]
        assert "[bad](javascript:window.pwned=1)" not in content.inner_text() and "bad" in texts("p")[0]
        assert '<img src=x onerror="window.pwned=2"> <script>window.pwned=3</script> snake_case_name' in texts("p")[0]
        assert texts("ul > li > ul > li") == ["nested"] and texts("ol > li") == ["first", "second"]
        assert texts("blockquote") == ["quoted"] and texts("th") == ["a", "b"] and texts("td") == ["1", "2"]
        assert content.locator("td.align-center").all_text_contents() == ["2"]
        assert texts(".code-block code") == ['print("<tag>")']
        assert tab.page.inner_text("#messages .message.user .content") == "<b>not bold</b>"
        assert tab.page.locator("#messages img, #messages script, #messages b").count() == 0
        assert tab.page.evaluate("() => window.pwned") is None
        assert tab.outside_requests() == []


def test_api_key_flow(browser):
    """With --api-key the page itself loads without the key, then asks for it; a wrong key is asked
    again; the right one is sent as a Bearer header, kept across a reload, and asked again (and the
    request retried) when the server refuses it."""
    server = ServerProcess(smollm2_args() + ["--api-key", KEY]).start()
    tab = Tab(browser, server.root_url("/"))
    try:
        page = tab.page
        page.wait_for_selector("#key-dialog", state="visible")
        assert page.inner_text("#key-message") == "This server needs an API key."
        tab.screenshot("chat-page-api-key.png")
        page.fill("#key-input", "wrong-key")
        page.click("#key-save")
        page.wait_for_function("() => document.getElementById('key-message').textContent.includes('refused')")
        assert page.is_visible("#key-dialog")
        page.fill("#key-input", KEY)
        page.click("#key-save")
        tab.wait_for_models()
        assert page.is_hidden("#key-dialog")
        page.reload()
        tab.wait_for_models()
        assert page.is_hidden("#key-dialog")
        # The key changed behind the page's back: the send gets a 401, the page asks, then retries.
        page.evaluate("() => localStorage.setItem('krafla.apiKey', 'stale-key')")
        tab.settings(temperature=0, max_tokens=8)
        tab.send(QUESTION)
        page.wait_for_selector("#key-dialog", state="visible")
        page.fill("#key-input", KEY)
        with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
            page.click("#key-save")
        assert sent.value.headers["authorization"] == f"Bearer {KEY}"
        tab.wait_for_reply()
        plain = plain_reply(server, [{"role": "user", "content": QUESTION}], key=KEY, temperature=0, max_tokens=8)
        assert tab.current()["messages"][-1]["content"] == plain.choices[0].message.content
        refused = [r for r in tab.requests if r.headers.get("authorization") in ("Bearer wrong-key", "Bearer stale-key")]
        assert {urllib.parse.urlparse(r.url).path for r in refused} == {"/v1/models", "/v1/chat/completions"}
    finally:
        # The refused requests are logged by the browser as failed loads (401): expected here.
        tab.close(expected_errors=("status of 401",))
        server.stop()


def test_switch_between_two_models(browser, tmp_path):
    """A server with two models (--models): the picker lists both, the chosen one answers (its reply is
    the one the API gives for that model, and not the other model's), and the choice survives a reload."""
    from openai import OpenAI

    smollm, coder = real_model("smollm2-135m"), real_model("qwen2.5-coder-0.5b")
    models = tmp_path / "models.toml"
    models.write_text("\n".join([
        "[[models]]", 'name = "smollm"', f'file = "{smollm.mlb}"', f'tokenizer = "{smollm.mlt}"', "",
        "[[models]]", 'name = "coder"', f'file = "{coder.mlb}"', f'tokenizer = "{coder.mlt}"', ""]))
    server = ServerProcess(["--models", str(models), "-t", "2"]).start()
    tab = Tab(browser, server.root_url("/"))
    try:
        page = tab.page
        two = "() => document.querySelectorAll('#model option').length === 2"
        page.wait_for_function(two)
        options = page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
        assert sorted(options) == ["coder", "smollm"]
        page.select_option("#model", "coder")
        page.reload()
        page.wait_for_function(two)
        assert page.input_value("#model") == "coder"
        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        replies = {}
        for name in ("coder", "smollm"):
            page.select_option("#model", name)
            page.click("#new-chat")
            tab.settings(temperature=0, max_tokens=12)
            with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
                tab.send(QUESTION)
            assert sent.value.post_data_json["model"] == name
            tab.wait_for_reply()
            replies[name] = tab.current()["messages"][-1]["content"]
            plain = client.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                                   temperature=0, max_tokens=12)
            assert replies[name] == plain.choices[0].message.content
        assert replies["coder"] != replies["smollm"]
    finally:
        tab.close()
        server.stop()
