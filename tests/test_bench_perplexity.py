"""bench/perplexity.py's arithmetic on the two programs' outputs: the estimates after each chunk read
from llama-perplexity's output, each chunk's own log-perplexity recovered from them, and the
standard error of the krafla / llama.cpp ratio over the chunks. Runs neither program (the script
itself is run by hand: bench/README.md)."""

import math

import numpy as np
import pytest

from tests.support.bench import bench_module


@pytest.fixture(scope="module")
def perplexity():
    """bench/perplexity.py as a module (it imports bench/compare.py from beside itself)."""
    with bench_module("perplexity") as module:
        yield module


def running_estimates(chunk_nlls):
    """What both programs print after each chunk: exp of the mean negative log-likelihood of every
    token scored so far (every chunk scoring as many tokens)."""
    flat = []
    out = []
    for chunk in chunk_nlls:
        flat.extend(chunk)
        out.append(math.exp(sum(flat) / len(flat)))
    return out


class ChunkTests:
    """chunk_log_perplexities and ratio_error against their definitions."""

    def test_each_chunks_mean_is_recovered(self, perplexity):
        """From the running estimates, each chunk's mean negative log-likelihood comes back."""
        rng = np.random.default_rng(1)
        chunks = rng.uniform(2, 7, (6, 5))
        got = perplexity.chunk_log_perplexities(running_estimates(chunks))
        assert np.allclose(got, chunks.mean(axis=1), rtol=1e-12)

    def test_ratio_error_is_the_standard_error_of_the_chunk_differences(self, perplexity):
        """The standard deviation of the chunks' log differences over sqrt(chunks); None for one chunk
        or lists of different lengths."""
        rng = np.random.default_rng(2)
        llama = rng.uniform(4, 6, (8, 3))
        krafla = llama + rng.normal(0, 0.05, (8, 1))
        differences = krafla.mean(axis=1) - llama.mean(axis=1)
        want = np.std(differences, ddof=1) / math.sqrt(8)
        got = perplexity.ratio_error(running_estimates(llama), running_estimates(krafla))
        assert got == pytest.approx(want, rel=1e-9)
        assert perplexity.ratio_error([40.0], [41.0]) is None
        assert perplexity.ratio_error([40.0, 41.0], [41.0]) is None

    def test_llama_perplexity_running_estimates_are_read(self, perplexity):
        """The final estimate and the `[i]value,` list llama-perplexity prints, in chunk order; None
        when the output has no final estimate."""
        output = "perplexity: calculating perplexity over 3 chunks\n[1]307.1846,[2]317.4109,[3]293.0662,\n" \
                 "Final estimate: PPL = 293.0662 +/- 30.1\n"
        assert perplexity.llama_estimate(output) == (293.0662, 30.1, [307.1846, 317.4109, 293.0662])
        assert perplexity.llama_estimate("main: error: failed to load model\n") is None
