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
