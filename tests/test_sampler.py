"""The C sampler (engine_c/src/sampler/sampler.c) against numpy references: greedy is argmax, top-k 1 is
greedy, the repeat penalty follows llama.cpp's rule, top-k/top-p keep the right tokens, draws
follow the softmax, and the random stream is xoshiro256** seeded by splitmix64 (reimplemented
here in Python), so a seed fixes the output. Also the rest of what a reply does with a row of
logits in C: its log probabilities and a grammar's mask."""

import collections
import ctypes
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import clib
from krafla_twisted.engine.sampler import Sampler, logprobs, mask_logits


@dataclass
class Params:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0


def draws(params, logits, n, history=()):
    with Sampler(params, len(logits)) as sampler:
        return [sampler.sample(logits, history) for _ in range(n)]


logit_rows = st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=60).map(
    lambda values: np.array(values, dtype=np.float32))


def penalised(logits, history, penalty, last_n, frequency=0.0, presence=0.0):
    """llama.cpp's penalties, in numpy float32: for each distinct id of the window once, the repeat
    penalty (positive logits divided, negative multiplied), then count * frequency + presence
    subtracted (llama_sampler_penalties' order); a result that overflows saturates."""
    out = logits.astype(np.float32).copy()
    window = history if last_n < 0 else history[max(0, len(history) - last_n):] if last_n else []
    counts = collections.Counter(int(t) for t in window)
    with np.errstate(over="ignore"):
        for token, count in counts.items():
            if out[token] == -np.inf:
                continue
            value = out[token] / np.float32(penalty) if out[token] > 0 else out[token] * np.float32(penalty)
            value = value - (np.float32(count) * np.float32(frequency) + np.float32(presence))
            if np.isinf(value):
                value = np.float32(np.finfo(np.float32).max) * np.sign(value)
            out[token] = value
    return out


class GreedyTests:
    @given(logits=logit_rows)
    def test_temperature_zero_is_first_argmax(self, logits):
        """Temperature 0 picks np.argmax (the lowest id among equal maxima)."""
        assert draws(Params(temperature=0.0), logits, 1) == [int(np.argmax(logits))]

    def test_ties_go_to_the_lowest_id(self):
        """Equal best logits: the lowest id wins."""
        logits = np.array([0.5, 2.0, 1.0, 2.0, 2.0], dtype=np.float32)
        assert draws(Params(), logits, 3) == [1, 1, 1]

    def test_long_rows_with_ties_zeros_and_minus_inf(self):
        """Rows of every length up to 300 and a vocabulary's worth, drawn from a few values so that
        maxima repeat in every lane and in the tail, with -0 beside +0 and -inf among them: the
        pick is np.argmax's, in the vectorised scan (kr_argmax_f32) as in the reference."""
        rng = np.random.default_rng(7)
        palette = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 3.0], dtype=np.float32)
        rows = [palette[rng.integers(0, len(palette), n)] for n in list(range(1, 301)) * 3 + [49152, 151936]]
        for row in rows:
            if np.all(row == -np.inf):
                row[-1] = -0.0
            with Sampler(Params(), len(row)) as sampler:
                assert sampler.sample(row) == int(np.argmax(row)), row

    def test_bad_values_anywhere_in_a_long_row(self):
        """NaN or +inf in the vector body or the tail of a 37-logit row is named, never picked."""
        for position in (0, 7, 8, 31, 32, 36):
            for bad, word in ((np.nan, "NaN"), (np.inf, r"\+inf")):
                row = np.zeros(37, dtype=np.float32)
                row[position] = bad
                with Sampler(Params(), 37) as sampler, pytest.raises(clib.KraflaError, match=f"token {position} is {word}"):
                    sampler.sample(row)

    @given(logits=logit_rows, seed=st.integers(0, 2**64 - 1))
    @example(logits=np.array([1e-45, 0.0, 0.0], dtype=np.float32), seed=0)
    def test_vanishing_temperature_and_top_p(self, logits, seed):
        """The smallest positive temperature gives one of the best tokens (no NaN from
        1/temperature; equal logits stay equally likely), and a top-p that rounds to nothing
        keeps exactly the best one (never an empty nucleus). A logit that trails the best by a
        subnormal amount, of the temperature's own size, is a real preference at that
        temperature (logits [1e-45, 0] at 1e-45 are softmax [e, 1]), so such a row may
        draw it."""
        best = np.flatnonzero(logits == logits.max()).tolist()
        gaps = logits.max() - logits[logits < logits.max()]
        allowed = best if np.all(gaps >= np.finfo(np.float32).tiny) else \
            np.flatnonzero(logits.max() - logits < np.finfo(np.float32).tiny).tolist()
        assert draws(Params(temperature=1e-45, seed=seed), logits, 1)[0] in allowed
        kept, _ = reference_keep(logits, 1.0, 0, 1e-45)  # ranks by probability, which may tie
        assert draws(Params(temperature=1.0, top_p=1e-45, seed=seed), logits, 1) == kept

    @given(logits=logit_rows, temperature=st.floats(0.05, 5), seed=st.integers(0, 2**64 - 1))
    def test_top_k_one_is_greedy(self, logits, temperature, seed):
        """top_k=1 gives the argmax at any temperature and seed."""
        assert draws(Params(temperature=temperature, top_k=1, seed=seed), logits, 3) == [int(np.argmax(logits))] * 3

    @given(logits=logit_rows, history=st.lists(st.integers(0, 1), max_size=10),
           penalty=st.floats(0.5, 3.0, width=32), last_n=st.integers(-1, 12))
    @example(logits=np.array([3.0, 2.0, 0.0], dtype=np.float32), history=[1, 0, 2, 2], penalty=2.0, last_n=3)
    def test_repeat_penalty_matches_llama_cpp_rule(self, logits, history, penalty, last_n):
        """Greedy after the penalty equals argmax of the numpy-penalised logits: positive logits
        divided, negative multiplied, each distinct id of the last N tokens once."""
        history = [t % len(logits) for t in history]
        expected = int(np.argmax(penalised(logits, history, penalty, last_n)))
        params = Params(repeat_penalty=penalty, repeat_last_n=last_n)
        assert draws(params, logits, 1, history) == [expected]

    @settings(max_examples=200, deadline=None)
    @given(logits=logit_rows, history=st.lists(st.integers(0, 3), max_size=12),
           penalty=st.sampled_from([1.0, 1.3]), last_n=st.integers(-1, 12),
           frequency=st.floats(-2, 2, width=32), presence=st.floats(-2, 2, width=32),
           temperature=st.sampled_from([0.0, 0.7, 1.5]), seed=st.integers(0, 2**64 - 1))
    def test_frequency_and_presence_penalties_match_llama_cpp_rule(self, logits, history, penalty, last_n, frequency,
                                                                   presence, temperature, seed):
        """OpenAI's frequency and presence penalties, after the repeat penalty as llama.cpp applies
        them: the draws (greedy or sampled, same seed) are the draws from the numpy-penalised logits
        with no penalty, so every penalised logit is the reference's to the bit."""
        history = [t % len(logits) for t in history]
        expected = draws(Params(temperature=temperature, seed=seed), penalised(logits, history, penalty, last_n,
                                                                                frequency, presence), 3)
        params = Params(temperature=temperature, seed=seed, repeat_penalty=penalty, repeat_last_n=last_n,
                        frequency_penalty=frequency, presence_penalty=presence)
        assert draws(params, logits, 3, history) == expected

    def test_frequency_penalty_counts_repeats(self):
        """A token seen three times loses 3 x the frequency penalty, one seen once 1 x; the presence
        penalty takes the same from both: so frequency reorders them and presence does not."""
        logits = np.array([5.0, 4.5, 3.0], dtype=np.float32)
        history = [0, 0, 0, 1]
        assert draws(Params(presence_penalty=1.0), logits, 1, history) == [0]    # 4 > 3.5 > 3
        assert draws(Params(frequency_penalty=0.5), logits, 1, history) == [1]   # 5 - 1.5 < 4.5 - 0.5
        assert draws(Params(frequency_penalty=2.0), logits, 1, history) == [2]   # -1 and 2.5 < 3
        assert draws(Params(frequency_penalty=-1.0), logits, 1, [1, 1, 1, 1, 1, 1]) == [1]  # negative: encouraged
        assert draws(Params(frequency_penalty=1.0, repeat_last_n=0), logits, 1, history) == [0]  # window off

    @pytest.mark.parametrize("last_n", [1, 3, 8])
    def test_window_edge(self, last_n):
        """The token exactly repeat_last_n back is inside the window (penalised); one further back is not."""
        logits = np.array([3.0, 2.5, 0.0], dtype=np.float32)
        params = Params(repeat_penalty=1.5, repeat_last_n=last_n)
        filler = [2] * (last_n - 1)
        assert draws(params, logits, 1, [2, 0] + filler) == [1]
        assert draws(params, logits, 1, [0, 2] + filler) == [0]

    def test_penalty_below_one_cannot_overflow(self):
        """A penalty below 1 on a huge logit saturates instead of making +inf (and NaN weights)."""
        logits = np.array([3e38, 1.0, -3e38], dtype=np.float32)
        for temperature in (0.0, 1.0):
            params = Params(temperature=temperature, repeat_penalty=1e-6, seed=1)
            assert draws(params, logits, 3, [0, 2]) == [0, 0, 0]
        # ...and a penalty above 1 cannot turn the only finite logit into -inf.
        logits = np.array([-3e38, -np.inf], dtype=np.float32)
        assert draws(Params(temperature=1.0, repeat_penalty=1e6, seed=1), logits, 3, [0]) == [0, 0, 0]

    def test_repeat_penalty_changes_the_choice(self):
        """A repeated best token loses to the runner-up; a negative one is pushed further down."""
        logits = np.array([1.0, 3.0, 2.5, -1.0], dtype=np.float32)
        assert draws(Params(), logits, 1, [1]) == [1]
        assert draws(Params(repeat_penalty=1.5), logits, 1, [1]) == [2]
        assert draws(Params(repeat_penalty=1.5, repeat_last_n=1), logits, 1, [1, 0]) == [1]  # 1 outside the window
        logits = np.array([-1.0, -1.1], dtype=np.float32)
        assert draws(Params(repeat_penalty=1.2), logits, 1, [0]) == [1]


# ------------------------------------------------------------------------------------------
# The random stream

MASK = 2**64 - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def xoshiro256starstar(seed):
    """The published generator, written from its definition."""
    state, s = seed, []
    for _ in range(4):
        state, value = splitmix64(state)
        s.append(value)

    def rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & MASK

    while True:
        result = (rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        yield result


class StreamTests:
    @pytest.mark.parametrize("seed", [0, 1, 42, 2**63 + 12345])
    def test_uniform_draws_follow_xoshiro(self, seed):
        """Over 1024 equal logits each draw is the top 10 bits of the next xoshiro256** output:
        this pins the generator, its seeding and the inverse-CDF walk."""
        stream = xoshiro256starstar(seed)
        expected = [next(stream) >> 54 for _ in range(50)]
        assert draws(Params(temperature=1.0, seed=seed), np.zeros(1024, dtype=np.float32), 50) == expected

    def test_same_seed_same_tokens_and_reseed_restarts(self):
        """Two samplers with one seed agree; reseeding restarts the stream; another seed differs."""
        logits = np.linspace(-2, 2, 300).astype(np.float32)
        params = Params(temperature=1.5, top_p=0.95, top_k=200, seed=7)
        first = draws(params, logits, 40)
        assert draws(params, logits, 40) == first
        with Sampler(params, len(logits)) as sampler:
            [sampler.sample(logits) for _ in range(5)]
            sampler.reseed(7)
            assert [sampler.sample(logits) for _ in range(40)] == first
        assert draws(Params(temperature=1.5, top_p=0.95, top_k=200, seed=8), logits, 40) != first


# ------------------------------------------------------------------------------------------
# Distributions


def reference_keep(logits, temperature, top_k, top_p, slack=0.0, min_p=0.0):
    """numpy: ids kept by top-k, top-p then min-p (best first, ties to the lower id) and their
    weights. `slack` widens (>0) or narrows (<0) the top-p goal to bracket rounding at the boundary.
    Min-p keeps the tokens at least min_p times as likely as the best (after temperature, as
    Hugging Face's and vLLM's samplers apply it)."""
    weights = np.exp((logits.astype(np.float64) - logits.max()) / np.float64(np.float32(temperature)))
    order = sorted(range(len(logits)), key=lambda i: (-weights[i], i))
    order = [i for i in order if weights[i] > 0]
    if top_k:
        order = order[:top_k]
    if top_p < 1.0:
        kept = weights[order]
        goal = np.float64(np.float32(top_p)) * kept.sum() * (1 + slack)
        cumulative = np.cumsum(kept)
        size = int(np.searchsorted(cumulative, min(goal, cumulative[-1]), side="left")) + 1
        order = order[:size]
    if min_p > 0:
        order = [i for i in order if weights[i] >= np.float64(np.float32(min_p))]
    return order, weights[order] / weights[order].sum()


class DistributionTests:
    @settings(max_examples=60, deadline=None)
    @given(logits=logit_rows, temperature=st.floats(0.1, 3.0), top_k=st.integers(0, 70),
           top_p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32),
           min_p=st.just(0.0) | st.floats(0.0, 1.0, width=32))
    def test_only_kept_tokens_are_drawn(self, logits, temperature, top_k, top_p, seed, min_p):
        """Every draw is among the tokens top-k, top-p and min-p keep (numpy reference, bracketed for
        rounding at the top-p boundary), and every kept token with a share above 1% shows up."""
        params = Params(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p)
        samples = draws(params, logits, 2000)
        widest, _ = reference_keep(logits, temperature, top_k, top_p, slack=1e-9, min_p=min_p * (1 - 1e-9))
        narrowest, shares = reference_keep(logits, temperature, top_k, top_p, slack=-1e-9, min_p=min_p * (1 + 1e-9))
        assert set(samples) <= set(widest)
        likely = {token for token, share in zip(narrowest, shares) if share > 0.01}
        assert likely <= set(samples)

    @pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
        (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (2.0, 4, 0.9, 0.0),
        (1.0, 0, 1.0, 0.2), (2.0, 0, 0.95, 0.3)])
    def test_frequencies_follow_the_softmax(self, temperature, top_k, top_p, min_p):
        """40000 draws with a fixed seed: each token's frequency is within 4.5 standard errors of
        its renormalised softmax probability (numpy)."""
        logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
        n = 40000
        params = Params(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234, min_p=min_p)
        samples = np.array(draws(params, logits, n))
        kept, probabilities = reference_keep(logits, temperature, top_k, top_p, min_p=min_p)
        expected = np.zeros(len(logits))
        expected[kept] = probabilities
        observed = np.bincount(samples, minlength=len(logits)) / n
        tolerance = 4.5 * np.sqrt(expected * (1 - expected) / n) + 1e-12
        assert np.all(np.abs(observed - expected) <= tolerance), (observed, expected)

    def test_masked_tokens_are_never_drawn(self):
        """-inf logits (masked tokens) are never chosen, even over many draws at high temperature."""
        logits = np.full(50, -np.inf, dtype=np.float32)
        logits[[3, 17]] = [0.0, 0.0]
        assert set(draws(Params(temperature=5.0, seed=9), logits, 500)) == {3, 17}

    def test_large_vocabulary_top_p(self):
        """A 262144-token vocabulary (Gemma 3's) with a flat tail: top-p keeps what numpy keeps."""
        rng = np.random.default_rng(0)
        logits = rng.normal(0, 1, 262144).astype(np.float32)
        logits[:20] += 12
        samples = draws(Params(temperature=1.0, top_p=0.9, seed=5), logits, 100)
        widest, _ = reference_keep(logits, 1.0, 0, 0.9, slack=1e-9)
        assert set(samples) <= set(widest)


# ------------------------------------------------------------------------------------------
# Bad input


class ValidationTests:
    @settings(max_examples=300, deadline=None)
    @given(logits=st.lists(st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False),
                                     st.just(-math.inf), st.sampled_from([3e38, -3e38, 0.0])), min_size=1, max_size=40)
           .filter(lambda values: any(v != -math.inf for v in values)),
           temperature=st.one_of(st.just(0.0), st.floats(1e-30, 1e4)), top_p=st.floats(0, 1),
           top_k=st.integers(0, 50), penalty=st.floats(1e-6, 1e6), last_n=st.integers(-1, 50),
           history=st.lists(st.integers(0, 39), max_size=20), seed=st.integers(0, 2**64 - 1))
    def test_any_valid_input_gives_a_valid_token(self, logits, temperature, top_p, top_k, penalty, last_n, history,
                                                  seed):
        """Extreme but valid logits and parameters always give an id of a token that is not
        masked (-inf): no NaN path, no out-of-range pick."""
        logits = np.array(logits, dtype=np.float32)
        history = [t % len(logits) for t in history]
        params = Params(temperature, top_p, top_k, penalty, last_n, seed)
        for token in draws(params, logits, 3, history):
            assert 0 <= token < len(logits) and logits[token] != -np.inf


    @pytest.mark.parametrize("field, value, fragment", [
        ("temperature", math.nan, "temperature"),
        ("temperature", -0.5, "temperature"),
        ("temperature", math.inf, "temperature"),
        ("top_p", 1.5, "top_p"),
        ("top_p", math.nan, "top_p"),
        ("top_k", -1, "top_k"),
        ("repeat_penalty", 0.0, "repeat_penalty"),
        ("repeat_penalty", math.nan, "repeat_penalty"),
        ("repeat_last_n", -2, "repeat_last_n"),
        ("frequency_penalty", math.nan, "frequency_penalty"),
        ("presence_penalty", math.inf, "presence_penalty"),
        ("min_p", -0.1, "min_p"),
        ("min_p", math.nan, "min_p"),
    ])
    def test_bad_parameters(self, field, value, fragment):
        """A bad parameter is refused at creation with a message naming it."""
        params = Params(**{field: value})
        with pytest.raises(clib.KraflaError, match=fragment):
            Sampler(params, 10)

    def test_bad_calls(self):
        """Wrong logits length, NaN or +inf logits, all -inf, and history ids outside the
        vocabulary are errors, not crashes; the sampler stays usable."""
        with Sampler(Params(temperature=1.0), 4) as sampler:
            with pytest.raises(clib.KraflaError, match="5 logits"):
                sampler.sample(np.zeros(5, dtype=np.float32))
            with pytest.raises(clib.KraflaError, match="NaN"):
                sampler.sample(np.array([0, np.nan, 0, 0], dtype=np.float32))
            with pytest.raises(clib.KraflaError, match=r"\+inf"):
                sampler.sample(np.array([0, np.inf, 0, 0], dtype=np.float32))
            with pytest.raises(clib.KraflaError, match="-inf"):
                sampler.sample(np.full(4, -np.inf, dtype=np.float32))
            with pytest.raises(clib.KraflaError, match="outside the vocabulary"):
                sampler.sample(np.zeros(4, dtype=np.float32), [1, 4])
            with pytest.raises(clib.KraflaError, match="outside the vocabulary"):
                sampler.sample(np.zeros(4, dtype=np.float32), [-1])
            assert sampler.sample(np.array([0, 0, 9, 0], dtype=np.float32)) in range(4)
        with pytest.raises(clib.KraflaError, match="vocabulary size"):
            Sampler(Params(), 0)

    def test_closed_sampler(self):
        """Sampling after close raises instead of touching freed memory."""
        sampler = Sampler(Params(), 3)
        sampler.close()
        with pytest.raises(clib.KraflaError, match="closed"):
            sampler.sample(np.zeros(3, dtype=np.float32))


def reference_logprobs(logits, token, top):
    """The log-softmax in float64 with numpy, and the `top` best (id, logprob), ties to the lower id."""
    values = np.asarray(logits, dtype=np.float64)
    logsum = values.max() + math.log(np.exp(values - values.max()).sum())
    order = sorted(range(len(values)), key=lambda t: (-values[t], t))[:top]
    return values[token] - logsum, [(t, values[t] - logsum) for t in order]


class LogprobsTests:
    """kr_logprobs (the API's logprobs, computed in C so the server needs no numpy) against numpy."""

    @settings(max_examples=200, deadline=None)
    @given(logits=logit_rows, data=st.data())
    @example(logits=np.array([1, 3, 3, 0, 3, -np.inf], dtype=np.float32), data=None)
    def test_matches_numpy(self, logits, data):
        """The token's logprob and the top alternatives, best first with ties to the lower id, as
        numpy gives them to within rounding of the sum."""
        if data is None:
            token, top = 5, 4
        else:
            token = data.draw(st.integers(0, len(logits) - 1))
            top = data.draw(st.integers(0, len(logits)))
        value, best = logprobs(logits, token, top)
        expected, expected_best = reference_logprobs(logits, token, top)
        assert value == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert [t for t, _ in best] == [t for t, _ in expected_best]
        assert [v for _, v in best] == pytest.approx([v for _, v in expected_best], rel=1e-12, abs=1e-12)

    def test_any_float32_row(self):
        """A memoryview of float32 (the server's rows) and a float64 array (converted) give the same figures."""
        rng = np.random.default_rng(5)
        logits = rng.normal(0, 3, 1000).astype(np.float32)
        expected = logprobs(logits, 17, 20)
        assert logprobs(memoryview(logits), 17, 20) == expected
        assert logprobs(logits.astype(np.float64), 17, 20) == expected
        assert logprobs(logits, 17, 5000) == logprobs(logits, 17, 1000)  # top beyond the vocabulary: all of it

    def test_bad_calls(self):
        """NaN, +inf, all -inf and a token outside the row are errors with a message, not crashes."""
        with pytest.raises(clib.KraflaError, match="NaN"):
            logprobs(np.array([0, np.nan, 0], dtype=np.float32), 0, 1)
        with pytest.raises(clib.KraflaError, match=r"\+inf"):
            logprobs(np.array([0, np.inf, 0], dtype=np.float32), 0, 1)
        with pytest.raises(clib.KraflaError, match="every logit is -inf"):
            logprobs(np.full(3, -np.inf, dtype=np.float32), 0, 1)
        with pytest.raises(clib.KraflaError, match="token 3 is outside"):
            logprobs(np.zeros(3, dtype=np.float32), 3, 1)
        with pytest.raises(ValueError, match="one row"):
            logprobs(np.zeros((2, 3), dtype=np.float32), 0, 1)


class MaskTests:
    """kr_logits_mask (a grammar's mask) against numpy's unpacking of the same bits."""

    @settings(max_examples=100, deadline=None)
    @given(n=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
    def test_forbidden_tokens_become_minus_inf(self, n, seed):
        rng = np.random.default_rng(seed)
        logits = rng.normal(0, 1, n).astype(np.float32)
        words = rng.integers(0, 2**32, (n + 31) // 32, dtype=np.uint64).astype(np.uint32)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)
        expected = np.where(allowed, logits, -np.inf).astype(np.float32)
        bits = (ctypes.c_uint32 * len(words))(*words.tolist())
        assert mask_logits(logits, bits) is logits
        assert logits.tobytes() == expected.tobytes()

    def test_in_place_only(self):
        """A row that cannot be written in place, or a mask short of bits, is refused."""
        bits = (ctypes.c_uint32 * 1)(5)
        with pytest.raises(ValueError, match="writeable C-contiguous row of float32"):
            mask_logits(np.zeros(4, dtype=np.float64), bits)
        with pytest.raises(ValueError, match="writeable"):
            mask_logits(np.zeros(8, dtype=np.float32)[::2], bits)
        with pytest.raises(ValueError, match="32 bits for 40 logits"):
            mask_logits(np.zeros(40, dtype=np.float32), bits)
        row = memoryview(bytearray(16)).cast("f")
        mask_logits(row, bits)
        assert row.tolist() == [0.0, -math.inf, 0.0, -math.inf]
