"""`krafla perplexity` (krafla_twisted/cli/perplexity.py) against a numpy computation of the same
quantity: llama-perplexity's method (chunks of ctx from an empty cache, BOS in front where the
tokenizer adds one, the second half scored, exp of the mean negative log-likelihood and its
error), written out here in float64 from Session.eval_all's logits of each whole chunk."""

import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from krafla_twisted.cli import perplexity
from krafla_twisted.engine.model import Model
from krafla_twisted.engine.tokenizer import Tokenizer
from tests.support.real_models import real_model
from tests.support.tiny_models import write_tiny_model

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data",
                    "devils-dictionary.txt")


def reference(model, tokens, ctx, n_chunks, bos_id):
    """(final perplexity, its error, running estimates) by the definition, in float64."""
    n_chunks = min(n_chunks, len(tokens) // ctx)
    nll = []
    running = []
    with model.session(ctx=ctx, batch=ctx) as session:
        for index in range(n_chunks):
            chunk = np.array(tokens[index * ctx:(index + 1) * ctx], np.int32)
            if bos_id is not None:
                chunk[0] = bos_id
            session.truncate(0)
            logits = session.eval_all(chunk).astype(np.float64)
            for position in range(ctx // 2, ctx - 1):
                row = logits[position]
                log_sum = row.max() + math.log(np.exp(row - row.max()).sum())
                nll.append(log_sum - row[chunk[position + 1]])
            running.append(math.exp(np.mean(nll)))
    nll = np.array(nll)
    mean = nll.mean()
    error = math.sqrt((np.mean(nll ** 2) - mean ** 2) / (len(nll) - 1)) * math.exp(mean)
    return math.exp(mean), error, running


class MeasureTests:
    """perplexity.measure on tiny models, against `reference`."""

    @pytest.mark.parametrize("arch, bos_id", [("llama", 1), ("gemma3", 2), ("qwen2", None)])
    def test_equals_the_definition(self, tmp_path, arch, bos_id):
        """Seven chunks of 16 from 120 tokens (the 8 left over unused), BOS replacing each chunk's
        first token or not: the same estimates as the definition, to float64 rounding."""
        path = tmp_path / "model.mlb"
        extra = {"final_softcap": 30.0} if arch == "gemma3" else {}
        write_tiny_model(path, arch, seed=5, weight_type="q8_0", max_seq=64, **extra)
        tokens = np.random.default_rng(4).integers(0, 60, size=120)
        with Model(path, threads=2) as model:
            result = perplexity.measure(model, tokens, ctx=16, batch=5, bos_id=bos_id)
            expected, error, running = reference(model, tokens, 16, 99, bos_id)
        assert result.n_chunks == 7 and result.count == 7 * 7
        assert result.perplexity == pytest.approx(expected, rel=1e-6)
        assert result.error == pytest.approx(error, rel=1e-5)
        assert result.running == pytest.approx(running, rel=1e-6)

    def test_pieces_do_not_change_the_result(self, tmp_path, monkeypatch):
        """Logits fetched a row at a time (a tiny LOGITS_BUDGET), or in steps of 3 or 64 tokens,
        give the same sums exactly: the engine's logits do not depend on the grouping."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, "qwen2", seed=6, weight_type="q4_0", max_seq=64)
        tokens = np.random.default_rng(8).integers(0, 60, size=70)
        with Model(path) as model:
            whole = perplexity.measure(model, tokens, ctx=32, n_chunks=2)
            small = perplexity.measure(model, tokens, ctx=32, n_chunks=2, batch=3)
            monkeypatch.setattr(perplexity, "LOGITS_BUDGET", 1)
            single = perplexity.measure(model, tokens, ctx=32, n_chunks=2, batch=64)
        assert whole.nll_sum == small.nll_sum == single.nll_sum
        assert whole.nll_square_sum == small.nll_square_sum == single.nll_square_sum

    def test_chunks_limit_and_short_text(self, tmp_path):
        """--chunks takes the first N chunks; a text under two chunks is refused with its token
        count and what the context needs, as llama-perplexity refuses it."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, "llama", seed=5, max_seq=64)
        tokens = np.arange(3, 53) % 60
        with Model(path) as model:
            two = perplexity.measure(model, tokens, ctx=16, n_chunks=2)
            three = perplexity.measure(model, tokens, ctx=16)
            assert (two.n_chunks, three.n_chunks) == (2, 3)
            assert two.running == three.running[:2]
            with pytest.raises(perplexity.PerplexityError, match="the text gives 50 tokens; a context of 32 needs at least 64"):
                perplexity.measure(model, tokens, ctx=32)
            with pytest.raises(perplexity.PerplexityError, match="--ctx must be at least 8, not 4"):
                perplexity.measure(model, tokens, ctx=4)


def cli(argv):
    """krafla perplexity ARGV in this process: (status, stdout, stderr)."""
    import argparse

    parser = argparse.ArgumentParser(prog="krafla perplexity")
    perplexity.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    status = perplexity.main(parser.parse_args(argv), stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def gemma():
    return real_model("gemma3-270m", "q4_0")


class CommandTests:
    """The command on the real Gemma3 q4_0 files (its tokenizer adds BOS) and the shipped text."""

    def test_result_equals_the_definition(self, gemma):
        """--ctx 32 --chunks 3 --json: the numbers of `reference` on the tokens of the text with BOS,
        and one progress line per chunk on stderr (not a terminal)."""
        status, out, err = cli([str(gemma.mlb), "-z", str(gemma.mlt), "-f", TEXT, "--ctx", "32", "--chunks", "3",
                                "-t", "2", "--json"])
        assert status == 0, err
        result = json.loads(out)
        with Tokenizer(str(gemma.mlt)) as tokenizer:
            assert tokenizer.add_bos
            tokens = tokenizer.encode(open(TEXT, encoding="utf-8").read(), add_eos=False)
            bos_id = tokenizer.bos_id
        with Model(str(gemma.mlb), threads=2) as model:
            expected, error, running = reference(model, tokens, 32, 3, bos_id)
        assert (result["chunks"], result["tokens_scored"]) == (3, 3 * 15)
        assert result["perplexity"] == pytest.approx(expected, rel=1e-6)
        assert result["error"] == pytest.approx(error, rel=1e-5)
        assert result["running"] == pytest.approx(running, rel=1e-6)
        progress = [line for line in err.splitlines() if line.startswith("[")]
        assert [line.split()[0] for line in progress] == ["[1/3]", "[2/3]", "[3/3]"]
        assert f"perplexity {running[-1]:.4f}" in progress[-1]

    def test_final_estimate_line(self, gemma):
        """Without --json, stdout is llama-perplexity's final line: PPL = value +/- error."""
        status, out, err = cli([str(gemma.mlb), "-z", str(gemma.mlt), "-f", TEXT, "--ctx", "16", "--chunks", "2"])
        assert status == 0, err
        value, error = out.split("Final estimate: PPL = ")[1].split(" +/- ")
        assert float(value) > 1 and float(error) > 0

    @pytest.mark.parametrize("extra, status, fragment", [
        (["--ctx", "4"], 2, "--ctx must be at least 8, not 4"),
        (["--chunks", "0"], 2, "--chunks must be at least 1, not 0"),
        (["-t", "0"], 2, "--threads must be at least 1, not 0"),
        (["--batch", "-1"], 2, "--batch must be at least 1, not -1"),
        (["--ctx", "100000"], 2, "--ctx 100000 is past the model's context length 32768"),
        (["--ctx", "65536", "--chunks", "1"], 2, "past the model's context length"),
    ])
    def test_bad_arguments(self, gemma, extra, status, fragment):
        """Each bad value: one line on stderr naming the option and the value, status 2."""
        code, out, err = cli([str(gemma.mlb), "-z", str(gemma.mlt), "-f", TEXT] + extra)
        assert (code, out) == (status, "")
        assert fragment in err and err.count("\n") == 1

    def test_bad_files(self, gemma, tmp_path):
        """A missing file, a text that is not UTF-8, a text too short, a tokenizer that is not one:
        status 1 and the file or the counts in the message."""
        short = tmp_path / "short.txt"
        short.write_text("A few words only.")
        latin1 = tmp_path / "latin1.txt"
        latin1.write_bytes("caf\xe9 ".encode("latin-1") * 400)
        cases = [
            ([str(gemma.mlb), "-z", str(gemma.mlt), "-f", str(tmp_path / "none.txt")], "none.txt: no such file"),
            ([str(gemma.mlb), "-z", str(gemma.mlt), "-f", str(latin1)], "latin1.txt: not UTF-8 text"),
            ([str(gemma.mlb), "-z", str(gemma.mlt), "-f", str(short)], "a context of 512 needs at least 1024"),
            ([str(gemma.mlb), "-z", str(short), "-f", TEXT], "short.txt"),
        ]
        for argv, fragment in cases:
            code, out, err = cli(argv)
            assert (code, out) == (1, ""), err
            assert fragment in err

    def test_installed_command(self, gemma):
        """`krafla perplexity --help` through the console entry point lists the options."""
        done = subprocess.run([sys.executable, "-m", "krafla_twisted.cli.main", "perplexity", "--help"],
                              capture_output=True, text=True, check=True)
        for option in ("-z", "-f", "--ctx", "--chunks", "-t", "--batch"):
            assert option in done.stdout
