"""`twistd krafla` options, parsed in process: where the model path may go, --host, the API key's sources."""

import pytest
from twisted.python import usage

from krafla_twisted.tap import Options, listen_url


@pytest.fixture
def files(tmp_path):
    model, tokenizer = tmp_path / "M.mlb", tmp_path / "T.mlt"
    model.write_bytes(b"x")
    tokenizer.write_bytes(b"x")
    return str(model), str(tokenizer)


def parse(args, monkeypatch, env_key=None):
    if env_key is None:
        monkeypatch.delenv("KRAFLA_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KRAFLA_API_KEY", env_key)
    options = Options()
    options.parseOptions(args)
    return options


class OptionsTests:
    """The original's options, and twistd's way of taking them."""

    def test_model_before_or_after_options(self, files, monkeypatch):
        """`krafla MODEL -z TOK --chat qwen -t 2` and `krafla -z TOK MODEL ...` read the same."""
        model, tokenizer = files
        first = parse([model, "-z", tokenizer, "--chat", "qwen", "-t", "2", "-p", "0.5", "--no-pack"], monkeypatch)
        second = parse(["-z", tokenizer, "--chat", "qwen", model, "-t", "2", "--top-p=0.5", "--no-pack"], monkeypatch)
        for options in (first, second):
            assert (options["model"], options["tokenizer"], options["chat"]) == (model, tokenizer, "qwen")
            assert (options["threads"], options["top-p"], options["no-pack"]) == (2, 0.5, True)
            assert (options["host"], options["port"]) == ("127.0.0.1", 8080)

    def test_defaults_without_model(self, monkeypatch):
        """No model argument is allowed (the default model is pulled at start); sampling defaults are the original's."""
        options = parse([], monkeypatch)
        assert options["model"] is None
        assert (options["temperature"], options["top-p"], options["top-k"], options["max-tokens"]) == (0.0, 0.9, 0, 0)

    def test_host(self, monkeypatch):
        """--host takes IPv4, IPv6 or localhost, not other names; the URL shows IPv6 in brackets."""
        assert parse(["--host", "localhost"], monkeypatch)["host"] == "127.0.0.1"
        assert parse(["--host", "0.0.0.0"], monkeypatch)["host"] == "0.0.0.0"
        assert parse(["--host", "::1"], monkeypatch)["host"] == "::1"
        assert listen_url("::1", 80) == "http://[::1]:80/v1"
        for bad in ("example.com", "127.0.0.256", ""):
            with pytest.raises(usage.UsageError, match="--host takes an IP address or localhost"):
                parse(["--host", bad], monkeypatch)

    def test_port_range(self, monkeypatch):
        """--port 0 (a free port) to 65535; others refused."""
        assert parse(["--port", "0"], monkeypatch)["port"] == 0
        for bad in ("-1", "65536"):
            with pytest.raises(usage.UsageError, match="--port"):
                parse(["--port", bad], monkeypatch)

    def test_api_key_sources(self, monkeypatch):
        """--api-key wins; without it KRAFLA_API_KEY is used; an empty key is refused."""
        assert parse([], monkeypatch)["api-key"] is None
        assert parse([], monkeypatch, env_key="from-env")["api-key"] == "from-env"
        assert parse(["--api-key", "flag"], monkeypatch, env_key="from-env")["api-key"] == "flag"
        with pytest.raises(usage.UsageError, match="--api-key"):
            parse(["--api-key", " "], monkeypatch)

    def test_engine_option_values_checked(self, files, monkeypatch):
        """Engine options are checked by the shared table: a bad template, temperature or kv type is a usage error."""
        model, tokenizer = files
        for args in (["--chat", "nope"], ["--temperature", "-1"], ["--kv", "q3"], ["-t", "0"]):
            with pytest.raises(usage.UsageError):
                parse([model, "-z", tokenizer, *args], monkeypatch)


class CorsOptionTests:
    """--cors takes origins exactly as a browser sends them in Origin, because they are compared byte for byte."""

    @pytest.mark.parametrize("value, origins", [
        ("*", ("*",)),
        ("http://localhost:3000", ("http://localhost:3000",)),
        ("https://app.example, http://[::1]:8000", ("https://app.example", "http://[::1]:8000")),
        ("chrome-extension://abcdef", ("chrome-extension://abcdef",)),
    ])
    def test_origins_accepted(self, value, origins, monkeypatch):
        """A wildcard, origins with and without a port, IPv6, another scheme; a list is split on commas."""
        assert parse(["--cors", value], monkeypatch)["cors"] == origins

    @pytest.mark.parametrize("value, hint", [
        ("localhost", None),
        ("localhost:3000", None),
        ("http://localhost:3000/", "http://localhost:3000"),
        ("http://LocalHost:3000", "http://localhost:3000"),
        ("https://app.example:443", "https://app.example"),
        ("http://app.example/path", None),
        ("http://user@app.example", None),
        ("http://app.example:99999", None),
        ("", None),
        ("http://a.example,,http://b.example", None),
    ])
    def test_not_an_origin_is_refused_at_start(self, value, hint, monkeypatch):
        """A value no browser would send as its Origin is a usage error naming it (and the origin it
        probably means), instead of a server that never grants CORS."""
        with pytest.raises(usage.UsageError, match="--cors takes origins") as caught:
            parse(["--cors", value], monkeypatch)
        part = value.split(",")[0] if value.count(",") < 2 else ""
        assert repr(part) in str(caught.value)
        if hint:
            assert f"did you mean {hint}?" in str(caught.value)

    def test_without_cors_no_origins(self, monkeypatch):
        """Without --cors no origin is allowed."""
        assert parse([], monkeypatch)["cors"] == ()
