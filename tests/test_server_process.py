"""`twistd krafla` as a process: options, the API key by flag and by environment, daemon mode.

Each test here needs its own server process (its options differ), so each keeps its requests few.
"""

import json
import os
import signal
import socket
import subprocess
import threading

import pytest

from krafla_twisted.engine import clib, formats
from tests.support.real_models import real_model
from tests.support.server import REPO, TWISTD, ServerProcess, server_env, treq_call, wait_for_listening, wait_until_removed

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def model():
    return real_model(MODEL)


def fetch(url, headers=None, body=None):
    """(status, JSON body) of one request, made with treq."""
    status, _, content = treq_call("POST" if body is not None else "GET", url, body, headers)
    return status, json.loads(content)


class APIKeyTests:
    """--api-key and KRAFLA_API_KEY."""

    def check_key(self, server, key):
        status, body = fetch(server.url("/models"))
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
        assert fetch(server.url("/models"), {"Authorization": "Bearer wrong"})[0] == 401
        status, body = fetch(server.url("/completions"), {"Authorization": f"Bearer {key}"}, {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert fetch(server.root_url("/health")) == (200, {"status": "ok"})

    def test_key_by_flag_alias_and_no_chat(self, model, tmp_path):
        """--api-key guards everything but /health; --alias names the model; with neither --chat nor
        a template named in the tokenizer file, chat is a 400."""
        plain_mlt = without_chat_template(model.mlt, tmp_path / "plain.mlt")
        server = ServerProcess([str(model.mlb), "-z", str(plain_mlt), "--api-key", "flag-key", "--alias", "my-model"]).start()
        try:
            self.check_key(server, "flag-key")
            status, body = fetch(server.url("/models"), {"Authorization": "Bearer flag-key"})
            assert [m["id"] for m in body["data"]] == ["my-model"]
            status, body = fetch(server.url("/chat/completions"), {"Authorization": "Bearer flag-key"},
                                 {"messages": [{"role": "user", "content": "Hi"}]})
            assert status == 400 and "--chat" in body["error"]["message"]
            assert any("chat none" in line for line in server.lines)
        finally:
            assert server.stop() in (0, -signal.SIGTERM)

    def test_key_by_environment(self, model):
        """KRAFLA_API_KEY is used when --api-key is not given, and the key is not in the process's arguments."""
        server = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "smollm"],
                               env={"KRAFLA_API_KEY": "env-key"}).start()
        try:
            self.check_key(server, "env-key")
            with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:
                assert b"env-key" not in f.read()
        finally:
            assert server.stop() in (0, -signal.SIGTERM)


def without_chat_template(mlt, out):
    """A copy of the .mlt `mlt` that names no chat template (as files converted before issue 17)."""
    container = formats.read(mlt, magic=formats.TOKENIZER_MAGIC)
    for key in ("chat_template", "chat_template_from", "chat_template_jinja"):
        container.metadata.pop(key, None)
    formats.write(out, container)
    return out


class TemplateFromFileTests:
    """The chat template the converter found in the model's own file (issue 17)."""

    CHAT = {"messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0}

    def reply(self, args):
        server = ServerProcess([*args, "-t", "1"]).start()
        try:
            status, body = fetch(server.url("/chat/completions"), None, self.CHAT)
            assert status == 200, body
            banner = server.wait_for(lambda line: "# krafla " in line)
            return body["choices"][0]["message"]["content"], body["usage"], banner
        finally:
            assert server.stop() in (0, -signal.SIGTERM)

    def test_server_without_chat_replies_as_with_it(self, model):
        """The pulled SmolLM2's .mlt names smollm (from the GGUF's own template): a server started
        without --chat says so in its banner and replies exactly as one started with --chat smollm."""
        assert formats.read(model.mlt, magic=formats.TOKENIZER_MAGIC).metadata["chat_template"] == "smollm"
        with_flag = self.reply([str(model.mlb), "-z", str(model.mlt), "--chat", "smollm"])
        from_file = self.reply([str(model.mlb), "-z", str(model.mlt)])
        assert from_file[:2] == with_flag[:2]
        assert from_file[0]
        assert "chat smollm (from the tokenizer file)" in from_file[2]
        assert "chat smollm," in with_flag[2]


class StartupTests:
    """The banner and refusals at start."""

    def test_banner(self, model):
        """The banner names version, ISA, model, context of max_seq, chat, threads, kv, and the slots with their
        KV memory (--parallel's default 4); then the listening line."""
        server = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "smollm", "-t", "1", "--ctx", "512"]).start()
        try:
            title = os.path.splitext(os.path.basename(str(model.mlb)))[0]
            banner = server.wait_for(lambda l: "# krafla " in l)
            isa = clib.load().kr_isa().decode()  # the server loads the same library (same environment)
            assert f"# krafla 0.7.0, isa {isa}: model {title}, context 512 of 8192, chat smollm, threads 1, kv f32" in banner
            # SmolLM2-135M: 30 layers x 512 positions x keys and values x 3 KV heads x 64 x 4 bytes = 22.5 MiB a slot
            assert banner.endswith(", kv f32, parallel 4 (KV cache 4 x 22.5 MiB)"), banner
            assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
            # Plain HTTP on --host/--port: pyOpenSSL stays out (tap.without_tls), with its cryptography
            # bindings (about 12 MiB resident); test_listen serves TLS when --listen asks for it.
            with open(f"/proc/{server.process.pid}/maps") as f:
                assert "cryptography/hazmat/bindings" not in f.read()
        finally:
            server.stop()

    def test_serves_without_numpy(self, model):
        """The server never loads numpy (about 12 MiB resident): replies in two slots side by side,
        streamed, with logprobs and logit_bias, and held to a JSON schema, all come from buffers
        the C library fills and reads. (Tests elsewhere check each of these replies' content.)"""
        server = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "smollm", "-t", "1", "--ctx", "256",
                                "--parallel", "2"]).start()
        try:
            chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6}
            requests = [
                ("/chat/completions", chat),
                ("/chat/completions", dict(chat, stream=True)),
                ("/chat/completions", dict(chat, logprobs=True, top_logprobs=3, logit_bias={"42": 3})),
                ("/completions", {"prompt": "Once upon", "max_tokens": 4, "logprobs": 2, "temperature": 0.8, "seed": 3}),
                ("/chat/completions", dict(chat, response_format={"type": "json_object"})),
            ]
            statuses = []
            calls = [threading.Thread(target=lambda r=r: statuses.append(treq_call("POST", server.url(r[0]), r[1])[0]))
                     for r in requests]
            for call in calls:
                call.start()
            for call in calls:
                call.join()
            assert statuses == [200] * len(requests)
            with open(f"/proc/{server.process.pid}/maps") as f:
                maps = f.read()
            assert "libkrafla" in maps and "_multiarray_umath" not in maps
        finally:
            server.stop()

    def test_unwritable_pack_cache_is_logged(self, model, tmp_path):
        """--pack-cache whose cache file cannot be written (a directory stands where it goes): the
        server still starts, packed in memory, and logs why at start."""
        mlb = tmp_path / "model.mlb"
        mlb.symlink_to(model.mlb)
        (tmp_path / "model.mlb.pack").mkdir()
        server = ServerProcess([str(mlb), "-z", str(model.mlt), "--chat", "smollm", "--pack-cache"]).start()
        try:
            line = next(line for line in server.lines if "--pack-cache:" in line)
            assert "pack cache not written" in line and "model.mlb.pack" in line and "Is a directory" in line, line
            assert fetch(server.url("/completions"), body={"prompt": "Hi", "max_tokens": 2})[0] == 200
        finally:
            assert server.stop() in (0, -signal.SIGTERM)

    def test_bad_options_refused(self, model, tmp_path):
        """A host name, a missing file, a bad value, a model that is not one, a busy port: exit 1 with a clear message,
        in the foreground and daemonized."""
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        not_a_model = tmp_path / "x.mlb"
        not_a_model.write_bytes(b"not a model file")
        model_args = [str(model.mlb), "-z", str(model.mlt)]
        cases = (
            (["--host", "example.com"], "--host takes an IP address or localhost"),
            (["/no/such/model.mlb", "-z", str(model.mlt)], "model file not found"),
            ([str(model.mlb)], "-z TOKENIZER.mlt is required"),
            (model_args + ["--temperature", "-1"], "--temperature must be at least 0"),
            ([str(not_a_model), "-z", str(model.mlt)], "cannot load the model"),
            (model_args + ["--port", str(busy.getsockname()[1])], "cannot listen on 127.0.0.1"),
            (model_args + ["--parallel", "0"], "--parallel must be 1 to 256"),
            # 256 slots of 8192 positions: 90 GiB of f32 KV cache for SmolLM2, more than this machine has
            (model_args + ["--parallel", "256", "--ctx", "8192"], "--parallel 256 x --ctx 8192 needs 90.0 GiB"),
        )
        from krafla_twisted.cli.startup import available_memory
        assert available_memory() < 90 * 2**30, "the KV-memory refusal below needs a machine with less memory"
        try:
            for daemon in (False, True):
                for args, message in cases:
                    twistd = ["--pidfile", str(tmp_path / "t.pid"), "--logfile", str(tmp_path / "t.log")] if daemon else ["-n"]
                    result = subprocess.run([TWISTD, *twistd, "krafla", *args], capture_output=True, text=True,
                                            env=server_env(), cwd=REPO, timeout=120)
                    assert result.returncode == 1, (args, daemon, result.stdout + result.stderr)
                    output = result.stdout + result.stderr
                    assert message in output, (daemon, output)
                    assert "Traceback" not in output, output
        finally:
            busy.close()


class DaemonTests:
    """twistd's own --pidfile and --logfile."""

    def test_daemon_pidfile_logfile_sigterm(self, model, tmp_path):
        """Start daemonized, serve, SIGTERM, pidfile gone; the log file has the banner and the request line."""
        pidfile, logfile = tmp_path / "krafla.pid", tmp_path / "krafla.log"
        result = subprocess.run(
            [TWISTD, "--pidfile", str(pidfile), "--logfile", str(logfile), "krafla", str(model.mlb), "-z", str(model.mlt),
             "--chat", "smollm", "--port", "0"],
            capture_output=True, text=True, env=server_env(), cwd=REPO, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        match = wait_for_listening(logfile)
        pid = int(pidfile.read_text())
        status, body = fetch(match.group(1) + "/completions", body={"prompt": "Hello", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        os.kill(pid, signal.SIGTERM)
        wait_until_removed(pidfile)
        log = logfile.read_text()
        assert "# krafla 0.7.0" in log and "POST /v1/completions 200 prompt" in log
