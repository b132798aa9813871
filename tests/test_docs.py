"""The documentation works: every relative link in README.md and docs/*.md resolves (anchors
included), and every example fenced as ```sh runnable or ```python runnable runs against a real
`twistd krafla` with SmolLM2-135M, the quickest real model (```python runnable-qwen: the same model
with `--chat qwen`, for the tool-call examples, which need a template with a tool format). The
README's curl example also runs against the default model as `make serve` serves it, and its
answer must be the right one, the one the README shows.

Examples are written for `make serve` (http://127.0.0.1:8080); here that address is replaced with
the test server's, and `.venv/bin/` with the folder of the Python running the tests. An example
passes when it exits 0 and prints no OpenAI error body.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from krafla_twisted.cli import models
from tests.support.real_models import real_model
from tests.support.server import LISTENING, REPO, ServerProcess, server_env

DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def prose(text):
    """The text without fenced blocks and inline code, where links are not links."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen = {}
    out = set()
    for _, heading in HEADING.findall(FENCE.sub("", read(path))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links():
    for path in DOCS:
        for target in LINK.findall(prose(read(path))):
            yield path, target


def runnable_blocks():
    out = []
    for path in DOCS:
        for info, code in FENCE.findall(read(path)):
            words = info.split()
            for marker in ("runnable", "runnable-qwen"):
                if marker in words[1:]:
                    out.append((os.path.relpath(path, REPO), words[0], code, marker))
    return out


BLOCKS = runnable_blocks()


class LinkTests:
    """Relative links and anchors in README.md and docs/*.md."""

    def test_relative_links_resolve(self):
        """Every relative link names an existing file or folder, and an #anchor names a heading of that page."""
        broken = []
        checked = 0
        for path, target in links():
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(resolved):
                broken.append(f"{os.path.relpath(path, REPO)}: {target} (no {os.path.relpath(resolved, REPO)})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{os.path.relpath(path, REPO)}: {target} (no heading #{anchor})")
        assert checked > 20
        assert not broken, "\n".join(broken)

    def test_checker_sees_a_broken_link(self, tmp_path):
        """The link and anchor rules catch a missing file and a missing heading (so the test above can fail)."""
        assert slug("`krafla bench`") == "krafla-bench" and slug("Request fields") == "request-fields"
        page = tmp_path / "page.md"
        page.write_text("# Title\n\n[ok](#title) [bad](missing.md) `[code](nowhere.md)`\n```\n[fenced](x.md)\n```\n")
        assert [t for t in LINK.findall(prose(page.read_text()))] == ["#title", "missing.md"]
        assert anchors(str(page)) == {"title"}


class ReadmeTests:
    def test_top_two_commands(self):
        """The README's first code block starts with `make serve` then `make test`, and those targets exist."""
        first = FENCE.findall(read(os.path.join(REPO, "README.md")))[0][1].splitlines()
        assert first[0].startswith("make serve") and first[1].startswith("make test")
        makefile = read(os.path.join(REPO, "Makefile"))
        assert re.search(r"^serve:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)

    def test_runnable_examples_everywhere(self):
        """The README, the quick start and the API page each keep runnable examples (the marker was not lost)."""
        files = {path for path, _, _, _ in BLOCKS}
        assert {"README.md", "docs/index.md", "docs/api.md"} <= files
        assert {lang for _, lang, _, _ in BLOCKS} == {"sh", "python"}


@pytest.fixture(scope="module")
def server():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2", "--metrics"]).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def default_server():
    """The default model as `make serve` serves it: the published file's own types, its own template."""
    model = real_model(models.DEFAULT_MODEL, None)
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2"]).start()
    yield process
    process.stop()


def readme_reply(command, root):
    """Run the README's curl command against the server at `root` (http://HOST:PORT); its reply's text."""
    command = command.replace("http://127.0.0.1:8080", root)
    result = subprocess.run(["bash", "-e", "-c", command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["object"] == "chat.completion", reply
    return reply["choices"][0]["message"]["content"]


class ReadmeAnswerTests:
    """The README's question gets the right answer from the default model."""

    def test_readme_curl_answers_paris(self, default_server):
        """The README's curl request (greedy: temperature 0 in its JSON body) asks the capital of France;
        the default model answers Paris, and the README shows that very reply."""
        command = read_readme_curl()
        body = json.loads(re.search(r"-d '(\{.*?\})'", command, re.DOTALL).group(1))
        assert body["temperature"] == 0
        assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
        content = readme_reply(command, default_server.root_url(""))
        assert "Paris" in content
        assert f'"content": {json.dumps(content)}' in read(os.path.join(REPO, "README.md"))


class RunnableExampleTests:
    """Each runnable example in the docs, against a real server."""

    @pytest.mark.parametrize("path, lang, code, marker", BLOCKS, ids=[f"{p}:{i}" for i, (p, _, _, _) in enumerate(BLOCKS)])
    def test_example(self, request, path, lang, code, marker):
        """The example exits 0 and prints no error body."""
        server = request.getfixturevalue("qwen_chat_server" if marker == "runnable-qwen" else "server")
        code = code.replace("http://127.0.0.1:8080", server.root_url(""))
        code = code.replace(".venv/bin/", os.path.dirname(sys.executable) + "/")
        if lang == "sh":
            command = ["bash", "-e", "-o", "pipefail", "-c", code]
        else:
            assert lang == "python", f"{path}: runnable examples are sh or python, not {lang}"
            command = [sys.executable, "-c", code]
        result = subprocess.run(command, cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{path}:\n{code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        assert '"error":' not in result.stdout, f"{path}:\n{code}\n{result.stdout}"


class FreshCloneTests:
    """The README's first command from a fresh clone of the committed tree: `make serve` builds, installs,
    pulls the default model (from the cache other tests fill) and serves, and the README's curl example
    gets the right answer from it."""

    def test_make_serve_then_readme_curl(self, tmp_path):
        """`make serve SERVE_ARGS="--port 0"` in a fresh clone reaches `# listening on` with the best ISA's
        library this CPU runs, printing a progress line per object, and the README's curl gets Paris."""
        clone = tmp_path / "krafla"
        subprocess.run(["git", "clone", "--quiet", REPO, str(clone)], check=True, timeout=300)
        env = server_env()
        env.pop("KRAFLA_LIB", None)  # the clone's own build
        env.pop("KRAFLA_ISA", None)  # `make test` sets it; the clone must pick the best ISA itself
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        make = subprocess.Popen(["make", "serve", "SERVE_ARGS=--port 0"], cwd=clone, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        lines = []
        found = threading.Event()

        def read():
            for line in make.stdout:
                lines.append(line)
                if LISTENING.search(line):
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            found.wait(900)
            match = next((LISTENING.search(line) for line in lines if LISTENING.search(line)), None)
            assert match, "make serve did not start:\n" + "".join(lines[-60:])
            from krafla_twisted.engine import clib
            banner = next(line for line in lines if "# krafla " in line and ", isa " in line)
            assert f", isa {clib.cpu_isa()}:" in banner  # the best library this CPU runs, without flags
            assert "Paris" in readme_reply(read_readme_curl(), match.group(1)[: -len("/v1")])
            assert re.search(r"^\[\s*\d+/\d+\] ", "".join(lines), re.MULTILINE)  # the build's progress lines
            assert os.path.exists(clone / ".venv" / "bin" / "krafla")
        finally:
            try:
                os.killpg(make.pid, signal.SIGTERM)  # make and the twistd it started, in the group made for them
            except ProcessLookupError:
                pass
            try:
                make.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait()
            shutil.rmtree(clone, ignore_errors=True)  # its .venv is a few hundred MB


def read_readme_curl():
    """The README's runnable curl example."""
    return next(code for path, lang, code, _ in BLOCKS if path == "README.md" and code.startswith("curl "))
