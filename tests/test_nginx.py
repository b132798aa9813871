"""deploy/ for real: two krafla replicas started as deploy/krafla@.service starts them, behind nginx
(Debian's package) configured by deploy/nginx-krafla.conf, driven over HTTPS by the openai client.

The unit's ExecStart line and the environment file are read from deploy/ and only their
machine-specific paths and ports are replaced (each replacement must find its text, so the test
follows the files). Each replica runs daemonized with its pidfile and log file and takes
KRAFLA_API_KEY from the environment file. nginx gets deploy/nginx-krafla.conf with loopback ports,
a certificate made by the test, and its own prefix folder.
"""

import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

import httpx2
import pytest

from tests.support.real_models import real_model
from tests.support.server import REPO, TWISTD, server_env
from tests.test_listen import make_certificate

DEPLOY = os.path.join(REPO, "deploy")
KEY = "sk-nginx-test"
COUNTING = "Count from 1 to 300, separated by commas: 1, 2, 3,"
QUESTION = "What is the capital of France?"


def replace_all(text, replacements):
    for old, new in replacements:
        assert old in text, f"{old!r} is no longer in the deploy file; update this test"
        text = text.replace(old, new)
    return text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_env_file(path):
    """KEY=VALUE lines as systemd's EnvironmentFile reads them (comments and blank lines skipped)."""
    env = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, value = line.partition("=")
                env[name.strip()] = value.strip()
    return env


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Replica:
    """One replica started with the unit's ExecStart, the instance name (%i) being its port."""

    def __init__(self, folder, model):
        self.port = free_port()
        self.folder = folder
        unit = open(os.path.join(DEPLOY, "krafla@.service"), encoding="utf-8").read()
        exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))[len("ExecStart="):]
        env = read_env_file(os.path.join(DEPLOY, "krafla.env"))
        assert env["KRAFLA_API_KEY"] and "--chat" in env["KRAFLA_ARGS"]
        env["KRAFLA_API_KEY"] = KEY
        env["KRAFLA_ARGS"] = f"{model.mlb} -z {model.mlt} --chat {model.chat} -t 1"
        self.pidfile = os.path.join(folder, f"run-{self.port}", "krafla.pid")
        self.logfile = os.path.join(folder, "log", f"krafla-{self.port}.log")
        os.makedirs(os.path.dirname(self.pidfile))  # systemd's RuntimeDirectory= and LogsDirectory=
        os.makedirs(os.path.dirname(self.logfile), exist_ok=True)
        command = replace_all(exec_start, [
            ("/opt/krafla/.venv/bin/twistd", TWISTD),
            ("/run/krafla-%i/", os.path.dirname(self.pidfile) + "/"),
            ("/var/log/krafla/", os.path.dirname(self.logfile) + "/"),
            ("%i", str(self.port)),
            ("$KRAFLA_ARGS", env["KRAFLA_ARGS"]),
        ])
        started = subprocess.run(shlex.split(command), env=server_env(env), cwd=folder, capture_output=True, text=True,
                                 timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr  # twistd's parent waits for the start
        wait_for(lambda: "# listening on" in self.log(), 60, "the replica's listening line")
        self.pid = int(open(self.pidfile).read())

    def log(self):
        try:
            with open(self.logfile, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self):
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        wait_for(lambda: not os.path.exists(self.pidfile), 60, "the pidfile to go")


class Nginx:
    def __init__(self, folder, replicas, cert, key):
        self.https_port, self.http_port = free_port(), free_port()
        site = open(os.path.join(DEPLOY, "nginx-krafla.conf"), encoding="utf-8").read()
        site = replace_all(site, [
            ("server 127.0.0.1:8081 ", f"server 127.0.0.1:{replicas[0].port} "),
            ("server 127.0.0.1:8082 ", f"server 127.0.0.1:{replicas[1].port} "),
            ("listen 443 ssl;", f"listen 127.0.0.1:{self.https_port} ssl;"),
            ("listen 80;", f"listen 127.0.0.1:{self.http_port};"),
            ("/etc/ssl/krafla/fullchain.pem", cert),
            ("/etc/ssl/krafla/privkey.pem", key),
        ])
        with open(os.path.join(folder, "krafla.conf"), "w") as f:
            f.write(site)
        temp = "".join(f"{kind}_temp_path {folder}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        main = (
            ("user root;\n" if os.geteuid() == 0 else "")
            + f"worker_processes 1;\ndaemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log;\n"
            + "events { worker_connections 256; }\n"
            + f"http {{\naccess_log {folder}/access.log;\n{temp}include {folder}/krafla.conf;\n}}\n"
        )
        conf = os.path.join(folder, "nginx.conf")
        with open(conf, "w") as f:
            f.write(main)
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        assert os.path.exists(nginx), "nginx is not installed: `make tools` installs it from Debian's packages"
        checked = subprocess.run([nginx, "-t", "-p", folder, "-c", conf], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
        self.process = subprocess.Popen([nginx, "-p", folder, "-c", conf], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        wait_for(self._up, 30, "nginx to listen")
        self.url = f"https://127.0.0.1:{self.https_port}/v1"

    def _up(self):
        assert self.process.poll() is None, self.process.stderr.read()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.https_port)) == 0

    def stop(self):
        self.process.send_signal(signal.SIGQUIT)  # graceful shutdown
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    model = real_model("smollm2-135m")
    folder = str(tmp_path_factory.mktemp("deploy"))
    cert, key = make_certificate(folder)
    replicas = []
    proxy = None
    try:
        replicas.append(Replica(folder, model))
        replicas.append(Replica(folder, model))
        proxy = Nginx(folder, replicas, cert, key)
        yield proxy, replicas, cert
    finally:
        if proxy is not None:
            proxy.stop()
        for replica in replicas:
            replica.stop()


def client(url, cert, key=KEY):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300,
                  http_client=httpx2.Client(verify=ssl.create_default_context(cafile=cert)))


class NginxTests:
    """Scale-out and TLS through nginx with the files in deploy/."""

    def test_concurrent_streams_balanced(self, deployment):
        """Four concurrent streamed chats through nginx all get the greedy reply, and both replicas served some."""
        proxy, replicas, cert = deployment
        texts, errors = [], []

        def one():
            try:
                stream = client(proxy.url, cert).chat.completions.create(
                    model="local", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0,
                    stream=True)
                texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
            except Exception as e:  # reported below, with the thread's error
                errors.append(repr(e))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        assert len(texts) == 4 and len(set(texts)) == 1 and "Paris" in texts[0]
        for replica in replicas:
            assert "POST /v1/chat/completions 200" in replica.log(), replica.log()[-2000:]

    def test_stream_not_buffered(self, deployment):
        """A long streamed reply reaches the client piece by piece: the first text comes well before the end."""
        proxy, _, cert = deployment
        start = time.monotonic()
        first = None
        pieces = 0
        for chunk in client(proxy.url, cert).completions.create(model="local", prompt=COUNTING, max_tokens=200,
                                                                 temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text:
                pieces += 1
                if first is None:
                    first = time.monotonic() - start
        total = time.monotonic() - start
        assert pieces > 100
        assert first < total / 3, (first, total)

    def test_key_tls_and_redirect(self, deployment):
        """Through nginx the replicas' key from the environment file is enforced, plain HTTP redirects to HTTPS,
        and the replicas write their pidfiles and logs where the unit says."""
        from openai import AuthenticationError

        proxy, replicas, cert = deployment
        with pytest.raises(AuthenticationError):
            client(proxy.url, cert, key="wrong").models.list()
        assert [m.id for m in client(proxy.url, cert).models.list().data]
        redirect = httpx2.get(f"http://127.0.0.1:{proxy.http_port}/v1/models", follow_redirects=False)
        assert redirect.status_code == 301
        assert redirect.headers["location"].startswith("https://")
        for replica in replicas:
            assert os.path.exists(replica.pidfile) and "# krafla " in replica.log()


class SystemdUnitTests:
    def test_unit_verifies(self, tmp_path):
        """systemd-analyze verify accepts deploy/krafla@.service as instance krafla@8081 (with twistd at a real path)."""
        unit = open(os.path.join(DEPLOY, "krafla@.service"), encoding="utf-8").read()
        unit = replace_all(unit, [("/opt/krafla/.venv/bin/twistd", TWISTD)])
        path = tmp_path / "krafla@8081.service"
        path.write_text(unit)
        analyze = shutil.which("systemd-analyze")
        assert analyze, "systemd-analyze is missing: `make tools` installs it"
        result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        assert "Type=forking" in unit and "PIDFile=/run/krafla-%i/krafla.pid" in unit
        assert "--pidfile /run/krafla-%i/krafla.pid" in unit and "EnvironmentFile=/etc/krafla/krafla.env" in unit
