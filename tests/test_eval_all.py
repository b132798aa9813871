"""kr_session_eval_all / Session.eval_all: the logits of every token of a batch (perplexity).

Row i of eval_all must be, bit for bit, the logits kr_session_eval gives when token i is the last
one it evaluates: the independent side is the one-logit path, run one token at a time and on
fresh sessions over each prefix. Exact comparisons of the float32 bits, no tolerance.
"""

import numpy as np
import pytest

from krafla_twisted.engine.model import ContextFullError, InvalidTokenError, Model
from tests.support.real_models import real_model
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35


def bits(logits):
    return np.asarray(logits, np.float32).view(np.uint32)


def one_at_a_time(path, ids, *, threads=1):
    """(len(ids), n_vocab) logits from kr_session_eval, one token per call."""
    with Model(path, threads=threads) as model:
        session = model.session(ctx=len(ids) + 4, batch=1)
        return np.stack([session.eval([token]) for token in ids])


def assert_rows_equal(expected, actual, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    differ = np.flatnonzero((bits(expected) != bits(actual)).any(axis=1))
    assert not differ.size, f"{what}: rows {differ[:8]} differ from kr_session_eval's logits"


def tiny_model(tmp_path, arch, weight_type):
    path = tmp_path / f"{arch}-{weight_type}.mlb"
    if arch == "qwen35":
        write_tiny_qwen35(path, seed=21, weight_type=weight_type)
    else:
        # gemma3 with a final soft-cap, so the capped rows are pinned too
        extra = {"final_softcap": 30.0} if arch == "gemma3" else {}
        write_tiny_model(path, arch, seed=21, weight_type=weight_type, max_seq=128, **extra)
    return path


class TinyModelEvalAllTests:
    """Every architecture and weight type of the tiny models."""

    @pytest.mark.parametrize("weight_type", ["f32", "q4_0", "q8_0"])
    @pytest.mark.parametrize("arch", ARCHS + ("qwen35",))
    def test_rows_equal_one_logit_eval(self, tmp_path, arch, weight_type):
        """A 45-token eval_all in steps of 16 (three steps, the last partial) on 2 threads gives,
        row for row, the bits of a one-token-at-a-time eval on 1 thread."""
        path = tiny_model(tmp_path, arch, weight_type)
        with Model(path) as model:
            n_vocab = model.n_vocab
        ids = np.random.default_rng(3).integers(0, n_vocab, size=45).astype(np.int32)
        expected = one_at_a_time(path, ids)
        with Model(path, threads=2) as model:
            rows = model.session(ctx=64, batch=16).eval_all(ids)
        assert rows.dtype == np.float32
        assert_rows_equal(expected, rows, f"{arch} {weight_type}")

    @pytest.mark.parametrize("arch", ARCHS + ("qwen35",))
    def test_after_cached_tokens_and_last_row_is_eval(self, tmp_path, arch):
        """eval_all after 10 cached tokens scores positions 10..; its last row equals eval's
        logits of the same call on a fresh session over the whole prefix, and the session holds
        every token afterwards."""
        path = tiny_model(tmp_path, arch, "q8_0")
        with Model(path) as model:
            n_vocab = model.n_vocab
        ids = np.random.default_rng(7).integers(0, n_vocab, size=30).astype(np.int32)
        expected = one_at_a_time(path, ids)
        with Model(path, threads=2) as model:
            session = model.session(ctx=40, batch=7)
            session.eval(ids[:10], logits=False)
            rows = session.eval_all(ids[10:])
            assert session.n_tokens == 30
            fresh = model.session(ctx=40, batch=32).eval(ids)
        assert_rows_equal(expected[10:], rows, f"{arch} after 10 cached tokens")
        assert_rows_equal(fresh[None], rows[-1:], f"{arch} last row against eval of the prefix")

    def test_one_logit_eval_unchanged_between(self, tmp_path):
        """eval and eval_all interleave on one session: eval's logits after an eval_all are those
        of a session that only ran eval."""
        path = tiny_model(tmp_path, "llama", "q4_0")
        ids = np.arange(1, 25, dtype=np.int32)
        expected = one_at_a_time(path, ids)
        with Model(path) as model:
            session = model.session(ctx=32, batch=8)
            session.eval_all(ids[:12])
            assert_rows_equal(expected[12:13], session.eval(ids[12:13])[None], "eval after eval_all")
            assert_rows_equal(expected[13:], session.eval_all(ids[13:]), "eval_all after eval")


class EvalAllArgumentTests:
    """Bad arguments are refused before any work, leaving the session as it was."""

    @pytest.fixture
    def session(self, tmp_path):
        path = tiny_model(tmp_path, "qwen2", "f32")
        with Model(path) as model:
            yield model.session(ctx=16, batch=4)

    def test_empty_and_non_integer(self, session):
        """No tokens, a 2-D array, or floats: InvalidTokenError naming eval_all."""
        for bad in ([], [[1, 2]], [1.0, 2.0]):
            with pytest.raises(InvalidTokenError, match="eval_all|integers"):
                session.eval_all(bad)
        assert session.n_tokens == 0

    def test_token_outside_vocabulary(self, session):
        """An id past n_vocab (checked by the binding for int64 input, by C for int32) names the
        id and its index; nothing was evaluated."""
        n_vocab = session.model.n_vocab
        for dtype in (np.int64, np.int32):
            with pytest.raises(InvalidTokenError, match=f"token id {n_vocab} at index 2"):
                session.eval_all(np.array([1, 2, n_vocab], dtype))
        assert session.n_tokens == 0

    def test_past_the_context(self, session):
        """More tokens than the context holds: ContextFullError, the cache unchanged."""
        session.eval([1, 2, 3])
        with pytest.raises(ContextFullError, match="14 tokens after 3 do not fit in the context of 16"):
            session.eval_all(np.ones(14, np.int32))
        assert session.n_tokens == 3


class RealModelEvalAllTests:
    """The real q4_0 models (packed weights, real vocabularies)."""

    @pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
    def test_rows_equal_one_logit_eval(self, name):
        """40 tokens in eval_all steps of 16 on 2 threads: every row has the bits of the
        one-token-at-a-time eval."""
        path = real_model(name, "q4_0").mlb
        with Model(path) as model:
            n_vocab = model.n_vocab
        ids = np.random.default_rng(2).integers(0, n_vocab, size=40).astype(np.int32)
        expected = one_at_a_time(path, ids, threads=2)
        with Model(path, threads=2) as model:
            rows = model.session(ctx=64, batch=16).eval_all(ids)
        assert_rows_equal(expected, rows, name)
