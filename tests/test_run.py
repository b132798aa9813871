"""`krafla run` and the shared option table (krafla_twisted/cli/options.py): argparse and twistd
read the same options with the same defaults and limits; `krafla run` on the real SmolLM2 model
streams a reply, prints the stats line, and repeats itself for a seed."""

import argparse
import io
import os
import re
import subprocess
import sys

import pytest
from twisted.python import usage

from krafla_twisted.cli import options, run
from krafla_twisted.engine import clib
from krafla_twisted.generation.generate import GenerationResult

# ------------------------------------------------------------------------------------------
# Options


def run_parser():
    parser = argparse.ArgumentParser(prog="krafla run", exit_on_error=False)
    run.add_arguments(parser)
    return parser


class TwistdOptions(usage.Options):
    optParameters, optFlags = options.twistd_rows()


ALL = ["-z", "t.mlt", "--chat", "qwen", "--system", "Be brief.", "-t", "2", "--ctx", "128", "--kv", "f16",
       "--batch", "8", "--no-pack", "--eos", "7", "-T", "0.5", "--top-k", "5", "--min-p", "0.05", "--repeat-penalty", "1.2",
       "--repeat-last-n", "32", "--frequency-penalty", "0.25", "--presence-penalty", "-0.5", "-s", "3", "-n", "10", "--spec", "none", "--draft", "d.mlb", "--draft-tokenizer",
       "d.mlt", "--mlock"]
EXPECTED = {"tokenizer": "t.mlt", "chat": "qwen", "system": "Be brief.", "threads": 2, "ctx": 128, "kv": "f16",
            "batch": 8, "no_pack": True, "pack_cache": False, "eos": 7, "temperature": 0.5, "top_k": 5, "min_p": 0.05,
            "repeat_penalty": 1.2, "repeat_last_n": 32, "frequency_penalty": 0.25, "presence_penalty": -0.5, "seed": 3,
            "max_tokens": 10, "spec": "none", "draft": "d.mlb",
            "draft_tokenizer": "d.mlt", "mlock": True}


class OptionTableTests:
    def test_defaults_agree(self):
        """With no options, argparse and twistd give the documented defaults, the same for both."""
        from_run = options.values(run_parser().parse_args([]))
        twistd = TwistdOptions()
        twistd.parseOptions([])
        assert from_run == options.values(twistd)
        assert from_run == {"tokenizer": None, "chat": None, "system": None, "threads": None, "ctx": None,
                            "kv": "f32", "batch": 64, "no_pack": False, "pack_cache": False, "eos": None,
                            "temperature": 0.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                            "repeat_last_n": 64, "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": None,
                            "max_tokens": 0, "spec": "lookup", "draft": None,
                            "draft_tokenizer": None, "mlock": False}

    def test_every_option_parses_the_same(self):
        """Every option, typed the same way, gives the same values through argparse and twistd."""
        from_run = options.values(run_parser().parse_args(ALL + ["--top-p", "0.5"]))
        twistd = TwistdOptions()
        twistd.parseOptions(ALL + ["-p", "0.5"])
        assert from_run == options.values(twistd) == dict(EXPECTED, top_p=0.5)

    def test_p_is_the_prompt_for_run_and_top_p_for_the_server(self):
        """`krafla run -p TEXT` is the prompt (as ml_run's), the server's -p is top-p."""
        args = run_parser().parse_args(["-p", "Hello there", "--top-p", "0.3"])
        assert (args.prompt, args.top_p) == ("Hello there", 0.3)
        twistd = TwistdOptions()
        twistd.parseOptions(["-p", "0.3"])
        assert twistd["top-p"] == 0.3

    @pytest.mark.parametrize("argv, fragment", [
        (["-t", "0"], "--threads must be at least 1"),
        (["--ctx", "-5"], "--ctx must be at least 1"),
        (["--kv", "q4_0"], "--kv must be one of f32, f16, q8_0"),
        (["-T", "nan"], "--temperature must be a finite number"),
        (["-T", "-1"], "--temperature must be at least 0.0"),
        (["--top-p", "1.5"], "--top-p must be at most 1.0"),
        (["--top-k", "x"], "--top-k takes an integer"),
        (["--repeat-penalty", "0"], "--repeat-penalty must be at least"),
        (["-s", "-1"], "--seed must be at least 0"),
        (["-n", "-2"], "--max-tokens must be at least 0"),
        (["--chat", "alpaca"], "--chat must be one of llama3"),
    ])
    def test_bad_values_are_refused_by_both(self, argv, fragment):
        """A bad value is refused with a message naming the option, by argparse and by twistd."""
        with pytest.raises(argparse.ArgumentError, match=re.escape(fragment)):
            run_parser().parse_args(argv)
        with pytest.raises(usage.UsageError, match=re.escape(fragment)):
            TwistdOptions().parseOptions([a.replace("--top-p", "-p") for a in argv])

    def test_validate_checks_values_set_in_code(self):
        """validate() applies the same limits to values that did not come through a parser."""
        good = options.values(run_parser().parse_args([]))
        assert options.validate(good) == good
        with pytest.raises(options.OptionError, match="--batch"):
            options.validate(dict(good, batch=0))
        with pytest.raises(options.OptionError, match="--temperature takes a number"):
            options.validate(dict(good, temperature="hot"))


class StatsLineTests:
    def test_format(self):
        """The stats line gives prompt and reply token counts and speeds, cached tokens, finish."""
        result = GenerationResult("x", "length", 12, 64, 2, 0.5, 2.0)
        assert run.stats_line(result) == ("# prompt 12 tokens (2 cached), 20.0 tokens/s; "
                                          "reply 64 tokens, 32.0 tokens/s; length")
        assert run.stats_line(result, "avx512").endswith("; length; isa avx512")

    def test_prompt_status_only_on_a_terminal(self):
        """The prompt status line is drawn and erased on a terminal, and absent otherwise."""
        stream = io.StringIO()
        status = run.PromptStatus(stream, enabled=True)
        status(32, 96)
        status(96, 96)
        assert stream.getvalue() == "\r# prompt 32/96 tokens\r\x1b[K"
        quiet = io.StringIO()
        run.PromptStatus(quiet, enabled=False)(32, 96)
        assert quiet.getvalue() == ""


# ------------------------------------------------------------------------------------------
# krafla run on the real model


@pytest.fixture(scope="module")
def smollm():
    from tests.support.real_models import real_model

    return real_model("smollm2-135m")


def krafla_run(*argv, stdin=None, env=None):
    return subprocess.run([sys.executable, "-m", "krafla_twisted.cli.main", "run", *argv], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


STATS = re.compile(r"^# prompt (\d+) tokens \((\d+) cached\), [\d.]+ tokens/s; "
                   r"reply (\d+) tokens, [\d.]+ tokens/s; (?:speculation \d+/\d+ proposed tokens accepted; )?"
                   r"(stop|length); isa (generic|avx2|avx512)$")


class RunTests:
    def test_chat_reply_twice_the_same(self, smollm):
        """`krafla run --chat smollm -T 0 -p "What is the capital of France?"` prints a reply
        naming Paris and one stats line; a second run prints the same reply."""
        argv = [str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "smollm", "-T", "0", "-t", "2",
                "-p", "What is the capital of France?"]
        first = krafla_run(*argv)
        assert first.returncode == 0, first.stderr
        assert "Paris" in first.stdout
        stats = [line for line in first.stderr.splitlines() if line.startswith("# prompt")]
        assert len(stats) == 1 and STATS.match(stats[0]), first.stderr
        assert int(STATS.match(stats[0]).group(3)) > 0
        assert STATS.match(stats[0]).group(5) == clib.loaded_isa()  # the library the subprocess loaded
        second = krafla_run(*argv)
        assert second.stdout == first.stdout

    def test_seeded_sampling_from_stdin_repeats(self, smollm):
        """With -T 0.9 -s 7 and the prompt on stdin, two runs give the same text; -n caps it;
        another seed gives another text."""
        argv = [str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "none", "-T", "0.9", "-s", "7", "-n", "20"]
        first = krafla_run(*argv, stdin="Once upon a time\n")
        assert first.returncode == 0, first.stderr
        assert krafla_run(*argv, stdin="Once upon a time\n").stdout == first.stdout
        match = STATS.match(first.stderr.strip().splitlines()[-1])
        assert match and match.group(3) == "20" and match.group(4) == "length"
        other = krafla_run(*argv[:-4], "-s", "8", "-n", "20", stdin="Once upon a time\n")
        assert other.stdout != first.stdout

    def test_threads_and_batch_do_not_change_the_reply(self, smollm):
        """A seeded sampled reply is the same with -t 1 --batch 3 as with -t 2 --batch 64."""
        argv = [str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "smollm", "-T", "0.8", "-s", "5", "-n", "16",
                "-p", "Tell me about the sea."]
        one = krafla_run(*argv, "-t", "1", "--batch", "3")
        two = krafla_run(*argv, "-t", "2", "--batch", "64")
        assert one.returncode == 0, one.stderr
        assert one.stdout == two.stdout and one.stdout.strip()

    def test_system_prompt_and_streaming(self, smollm):
        """In-process: --system replaces SmolLM's default system prompt (the stats line counts the
        prompt as templates.render does), and the reply reaches stdout piece by piece, each flushed."""
        from krafla_twisted.chat import templates
        from krafla_twisted.engine.tokenizer import Tokenizer

        class Recorder(io.StringIO):
            flushes = 0

            def flush(self):
                self.flushes += 1

        tokenizer = Tokenizer(str(smollm.mlt))
        for system in (None, "Answer in French."):
            argv = [str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "smollm", "-n", "12", "-t", "2",
                    "-p", "What is the capital of France?"] + (["--system", system] if system else [])
            stdout, stderr = Recorder(), io.StringIO()
            assert run.main(run_parser().parse_args(argv), stdout=stdout, stderr=stderr) == 0, stderr.getvalue()
            expected = templates.get_template("smollm").render([{"role": "user", "content": "What is the capital of France?"}],
                                                          tokenizer, system=system)
            match = STATS.match(stderr.getvalue().strip())
            assert match and int(match.group(1)) == len(expected)
            assert stdout.flushes >= 3 and stdout.getvalue().strip()

    def test_default_model(self, smollm):
        """Without a model argument the default model (already pulled) is used, with its own chat
        template: the same reply as naming its files with its --chat."""
        from krafla_twisted.cli import models
        from tests.support.real_models import real_model

        default_files = real_model(models.DEFAULT_MODEL, None)  # what a pull gives by default: the file's own types
        assert default_files.chat == "qwen"
        named = krafla_run(str(default_files.mlb), "-z", str(default_files.mlt), "--chat", "qwen", "-n", "12", "-p", "Hi!")
        default = krafla_run("-n", "12", "-p", "Hi!")
        assert default.returncode == 0, default.stderr
        assert default.stdout == named.stdout and default.stdout.strip()

    def test_interactive_chat_reuses_the_cache(self, smollm):
        """`-i`: each stdin line is the next user message; the second turn's prompt starts with the
        first prompt and reply, so all of those tokens come from the KV cache."""
        result = krafla_run(str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "smollm", "-i", "-n", "40", "-t", "2",
                            stdin="What is the capital of France?\n\nAnd of Germany?\n")
        assert result.returncode == 0, result.stderr
        stats = [STATS.match(line) for line in result.stderr.splitlines() if line.startswith("# prompt")]
        assert len(stats) == 2 and all(stats)
        first_prompt, _, first_reply, first_finish = (stats[0].group(i) for i in (1, 2, 3, 4))
        assert first_finish == "stop"  # so every reply token was evaluated
        assert int(stats[1].group(2)) == int(first_prompt) + int(first_reply)
        assert "Paris" in result.stdout and "Berlin" in result.stdout

    def test_terminal_without_prompt_is_a_chat(self, smollm):
        """On a terminal with no -p and a chat template, krafla run chats: a `> ` prompt on
        stderr, one reply per line, Ctrl-D ends it."""
        import pty

        controller, terminal = pty.openpty()
        process = subprocess.Popen([sys.executable, "-m", "krafla_twisted.cli.main", "run", str(smollm.mlb), "-z",
                                    str(smollm.mlt), "--chat", "smollm", "-n", "24"],
                                   stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.close(terminal)
        os.write(controller, b"What is the capital of France?\n\x04")
        out, err = process.communicate(timeout=300)
        os.close(controller)
        assert process.returncode == 0, err
        assert "Paris" in out
        assert err.startswith("> ") and err.count("# prompt") == 1

    def test_interactive_needs_a_template(self, smollm):
        """-i with --chat none is refused: it is a chat."""
        result = krafla_run(str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "none", "-i", stdin="Hi\n")
        assert result.returncode == 1 and "--chat" in result.stderr

    def test_template_from_the_tokenizer_file(self, smollm):
        """Without --chat, the template the .mlt names (smollm, found in the GGUF's own template)
        renders the prompt, and stderr says so: the same reply as with --chat smollm. --chat none
        gives the plain-text reply instead."""
        argv = [str(smollm.mlb), "-z", str(smollm.mlt), "-T", "0", "-n", "12", "-t", "2", "-p", "Hi!"]
        named = krafla_run(*argv, "--chat", "smollm")
        from_file = krafla_run(*argv)
        plain = krafla_run(*argv, "--chat", "none")
        assert from_file.returncode == 0, from_file.stderr
        assert from_file.stdout == named.stdout and from_file.stdout.strip()
        assert "chat template smollm (from the tokenizer file" in from_file.stderr
        assert "chat template" not in named.stderr and "chat template" not in plain.stderr
        assert plain.stdout != named.stdout

    @pytest.mark.parametrize("argv, fragment", [
        (["/nonexistent/model.mlb", "-z", "/nonexistent/tok.mlt", "-p", "x"], "/nonexistent/model.mlb"),
        (["MODEL", "-p", "x"], "-z TOKENIZER.mlt is required"),
        (["MODEL", "-z", "TOK", "-p", ""], "the prompt is empty"),
        (["MODEL", "-z", "TOK", "--no-pack", "--pack-cache", "-p", "x"], "--pack-cache"),  # speed: the engine packs now
        (["MODEL", "-z", "TOK", "--eos", "999999", "-p", "x"], "--eos 999999 is not a token id of this model"),
    ])
    def test_errors_are_one_line(self, smollm, argv, fragment):
        """Bad files and arguments exit 1 with one `krafla run:` line naming the problem."""
        argv = [str(smollm.mlb) if a == "MODEL" else str(smollm.mlt) if a == "TOK" else a for a in argv]
        result = krafla_run(*argv)
        assert result.returncode == 1
        assert result.stderr.startswith("krafla run: ") and fragment in result.stderr
        assert "Traceback" not in result.stderr

    def test_context_too_small(self, smollm):
        """A prompt longer than --ctx is refused before any work, with the sizes in the message."""
        result = krafla_run(str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "none", "--ctx", "4",
                            "-p", "one two three four five six")  # plain text: the six words are six tokens
        assert result.returncode == 1
        assert "maximum context length is 4 tokens. However, the prompt has 6 tokens" in result.stderr


@pytest.fixture(autouse=True)
def _library_env(monkeypatch):
    """Subprocesses find the same library as this process."""
    if "KRAFLA_LIB" not in os.environ:
        from krafla_twisted.engine import clib

        monkeypatch.setenv("KRAFLA_LIB", clib.library_path())
