"""`--listen` with Twisted endpoint strings: TLS with a self-signed certificate and a unix socket, no proxy.

One real `twistd -n krafla` with the real SmolLM2 model listens on a unix socket and on TLS at once;
the certificate is made here with the `cryptography` package, so the TLS side is checked by clients
that verify it (the openai library through httpx2, and curl) and refused by one that does not trust it.
"""

import datetime
import http.client
import ipaddress
import json
import os
import re
import socket
import ssl
import subprocess
import threading

import httpx2
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from twisted.python import usage

from krafla_twisted.tap import Options
from tests.support.real_models import real_model
from tests.support.server import REPO, START_TIMEOUT, TWISTD, ServerProcess

QUESTION = "What is the capital of France?"


def make_certificate(folder, host="127.0.0.1"):
    """(cert.pem, key.pem) of a fresh self-signed certificate for `host` (an IP address) and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "krafla test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=300):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


@pytest.fixture(scope="module")
def model():
    return real_model("smollm2-135m")


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_certificate(str(tmp_path_factory.mktemp("tls")))


class EndpointServer(ServerProcess):
    """A `twistd -n krafla` started with its own --listen strings (no --port 0): ready at its https line."""

    def start(self, timeout=START_TIMEOUT):
        self.process = subprocess.Popen([TWISTD, "-n", "--pidfile=", "krafla", *self.args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env=self.env, cwd=REPO, text=True, encoding="utf-8",
                                        errors="replace")
        threading.Thread(target=self._read, daemon=True, name="server-log").start()
        self.wait_for(lambda line: "# listening on https://" in line, timeout)
        log = "\n".join(self.lines)
        self.https = re.search(r"# listening on (https://\S+/v1)", log).group(1)
        self.unix = re.search(r"# listening on unix:(\S+) \(http://localhost/v1\)", log).group(1)
        return self


@pytest.fixture(scope="module")
def server(model, tls, tmp_path_factory):
    cert, key = tls
    sock = str(tmp_path_factory.mktemp("sock") / "krafla.sock")
    tls_endpoint = f"ssl:0:privateKey={key}:certKey={cert}:interface=127.0.0.1"
    process = EndpointServer([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2",
                              "--listen", f"unix:{sock}", "--listen", tls_endpoint])
    yield process.start()
    process.stop()


class ListenTests:
    """TLS and a unix socket straight from twistd, with the real model."""

    def test_unix_socket(self, server):
        """A chat completion over the unix socket (--listen unix:PATH) gets the real model's reply."""
        connection = UnixConnection(server.unix)
        body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        reply = json.loads(response.read())
        assert response.status == 200, reply
        assert "Paris" in reply["choices"][0]["message"]["content"]
        assert os.stat(server.unix).st_mode & 0o170000 == 0o140000  # a socket file

    def test_tls_openai_client_verifies_certificate(self, server, tls):
        """The openai client, trusting only the test's certificate, streams a chat over https; a client with the
        system's trust store refuses the self-signed certificate."""
        from openai import OpenAI

        cert, _ = tls
        client = OpenAI(base_url=server.https, api_key="none", max_retries=0,
                        http_client=httpx2.Client(verify=ssl.create_default_context(cafile=cert)))
        messages = [{"role": "user", "content": QUESTION}]
        plain = client.chat.completions.create(model="local", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="local", messages=messages, max_tokens=12, temperature=0, stream=True) if chunk.choices)
        assert "Paris" in plain.choices[0].message.content
        assert streamed == plain.choices[0].message.content
        with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx2.get(server.https + "/models", verify=True)

    def test_tls_curl(self, server, tls):
        """curl --cacert reaches /health over TLS (TLS is real: plain http on the same port is not answered as HTTP)."""
        cert, _ = tls
        result = subprocess.run(["curl", "-sS", "--cacert", cert, server.https.replace("/v1", "/health")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"status": "ok"}
        plain = subprocess.run(["curl", "-sS", "-m", "10", server.https.replace("https://", "http://") + "/models"],
                               capture_output=True, text=True, timeout=60)
        assert plain.returncode != 0 or not plain.stdout.startswith("{")


class ListenOptionTests:
    """--listen strings are parsed with the options: a wrong one is a usage error, not a failed start."""

    def test_bad_descriptions_refused(self, tmp_path, monkeypatch):
        """An unknown endpoint type and an ssl: endpoint whose key file is missing are UsageErrors naming --listen."""
        monkeypatch.delenv("KRAFLA_API_KEY", raising=False)
        for bad in ["carrier-pigeon:8080", f"ssl:8443:privateKey={tmp_path}/missing.pem", ""]:
            with pytest.raises(usage.UsageError, match="--listen"):
                Options().parseOptions(["--listen", bad])

    def test_repeatable(self, tls, monkeypatch):
        """--listen may be given several times; each string is kept in order."""
        monkeypatch.delenv("KRAFLA_API_KEY", raising=False)
        cert, key = tls
        wanted = ["tcp:0:interface=127.0.0.1", "unix:/tmp/x.sock", f"ssl:0:privateKey={key}:certKey={cert}"]
        options = Options()
        options.parseOptions([arg for text in wanted for arg in ("--listen", text)])
        assert options["listen"] == wanted

    def test_taken_address_fails_start(self, model):
        """--listen on an address already in use stops the start with exit status 1 and a line naming the endpoint."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            where = f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1"
            result = subprocess.run([TWISTD, "-n", "--pidfile=", "krafla", str(model.mlb), "-z", str(model.mlt),
                                     "--listen", where], capture_output=True, text=True, timeout=300, cwd=REPO,
                                    env=ServerProcess([]).env)
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"cannot listen on {where}" in result.stdout + result.stderr
