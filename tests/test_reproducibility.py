"""Bitwise reproducibility of the engine (docs/architecture.md, "Invariants the tests pin").

For one model and one token sequence, the logits must be identical bit for bit whatever the
batch size, the number of threads, and however the sequence is split across eval calls
(including a prefix kept in the KV cache after truncate). These are exact comparisons
(array_equal on the raw float32 bits), not tolerances.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krafla_twisted.engine.model import Model
from tests import strategies
from tests.support.real_models import real_model
from tests.support.tiny_models import ARCHS, write_tiny_model

BATCHES = (1, 7, 32, None)  # None: the whole prompt in one step


def bits(logits):
    return np.asarray(logits, np.float32).view(np.uint32)


def run(path, ids, *, threads=1, batch=None, kv="f32", splits=()):
    """Logits after evaluating ids, in calls cut at `splits`, one session of `batch`."""
    with Model(path, threads=threads) as model:
        session = model.session(ctx=len(ids) + 8, batch=batch or len(ids), kv=kv)
        logits = None
        for part in np.split(np.asarray(ids, np.int32), list(splits)):
            logits = session.eval(part)
        return bits(logits)


def assert_same(reference, other, what):
    mismatched = np.flatnonzero(reference != other)
    assert not mismatched.size, f"{what}: {mismatched.size} logits differ, first at {mismatched[:5]}"


class TinyModelReproducibilityTests:
    """Every architecture, float and quantized weights, f32 and f16 caches."""

    @pytest.mark.parametrize("kv", ["f32", "f16"])
    @pytest.mark.parametrize("weight_type", ["f32", "q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"])
    @pytest.mark.parametrize("arch", ARCHS)
    def test_batch_threads_and_splits(self, tmp_path, arch, weight_type, kv):
        """A 70-token prompt (longer than the 32 batch and gemma3's window) gives the same logits
        for batches 1, 7, 32 and 70, for 1 and 2 threads, and in two or three calls."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, arch, seed=11, weight_type=weight_type, max_seq=128)
        ids = [int(t) for t in np.random.default_rng(5).integers(0, 60, size=70)]
        expected = run(path, ids, kv=kv)
        for batch in BATCHES:
            for threads in (1, 2):
                assert_same(expected, run(path, ids, threads=threads, batch=batch, kv=kv), f"batch {batch}, {threads} threads")
        assert_same(expected, run(path, ids, batch=32, kv=kv, splits=[41]), "two calls")
        assert_same(expected, run(path, ids, threads=2, batch=7, kv=kv, splits=[1, 33]), "three calls")

    @pytest.mark.parametrize("weight_type", ["q4_0", "q4_K", "q6_K"])
    @pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
    def test_one_token_steps_on_more_threads_than_cores(self, tmp_path, arch, weight_type):
        """One token a step, a matmul's rows are cut into one contiguous share per thread, and a
        thread whose share is done takes the back half of what is left of another's (threads.c,
        kr_pool_run_shares). Six threads on this machine's fewer cores: some start late and others
        take from their shares, and some shares of the small matrices are empty. The logits are
        still those of one thread."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, arch, seed=4, weight_type=weight_type, max_seq=128)
        ids = [int(t) for t in np.random.default_rng(8).integers(0, 60, size=48)]
        expected = run(path, ids, batch=1)
        for threads in (2, 6):
            assert_same(expected, run(path, ids, threads=threads, batch=1), f"{threads} threads")

    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(args=strategies.tiny_models_args(), batch=st.integers(1, 20), split=st.integers(1, 39),
           threads=st.sampled_from([1, 2, 3]))
    def test_hypothesis_shapes(self, tmp_path, args, batch, split, threads):
        """Any drawn shape: batch b with t threads in two calls equals one whole-prompt step on
        one thread."""
        arch, weight_type, kwargs = args
        kwargs["max_seq"] = 64
        path = tmp_path / "model.mlb"
        write_tiny_model(path, arch, weight_type=weight_type, **kwargs)
        ids = [int(t) for t in np.random.default_rng(kwargs["seed"] % 1000).integers(0, kwargs["n_vocab"], size=40)]
        assert_same(run(path, ids), run(path, ids, threads=threads, batch=batch, splits=[split]),
                    f"batch {batch}, {threads} threads, split at {split}")

    def test_truncated_cache_reuse(self, tmp_path):
        """A prompt that shares a prefix with the cached one, run after truncate, gives the same
        logits as from an empty cache: the server's prefix reuse is exact."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, "gemma3", seed=3, weight_type="q4_0", max_seq=128)
        rng = np.random.default_rng(1)
        first = rng.integers(0, 70, size=50).astype(np.int32)
        second = np.concatenate([first[:37], rng.integers(0, 70, size=20).astype(np.int32)])
        fresh = run(path, second, batch=16)
        with Model(path, threads=2) as model:
            session = model.session(ctx=128, batch=16)
            session.eval(first)
            session.truncate(37)
            assert_same(fresh, bits(session.eval(second[37:])), "after truncate")

    @pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
    def test_attention_blocks_of_any_size(self, tmp_path, kv):
        """Attention takes up to 64 queries of a KV head per work item, fewer in a long context
        (model/layers.c: 2^22 floats of scores per thread, so 4 queries at 2^20 positions, 2 at 2^21:
        a token's 4 query heads split between items). The logits are the same bits for each,
        with 1 and 3 threads, and in every KV cache type."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, "gemma3", seed=8, weight_type="q8_0", max_seq=128)
        ids = [int(t) for t in np.random.default_rng(9).integers(0, 70, size=70)]
        expected = run(path, ids, kv=kv)
        for ctx in (1 << 20, 1 << 21):
            for threads in (1, 3):
                with Model(path, threads=threads) as model:
                    session = model.session(ctx=ctx, batch=len(ids), kv=kv)
                    assert_same(expected, bits(session.eval(ids)), f"context {ctx}, {threads} threads")

    def test_generation_step_equals_prompt_step(self, tmp_path):
        """Logits of token i from a one-token eval equal those from a batch ending at token i."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, "qwen2", seed=4, weight_type="q8_0")
        ids = list(range(3, 43))
        with Model(path, threads=2) as model:
            session = model.session(batch=32)
            for i, token in enumerate(ids):
                step = bits(session.eval([token]))
                assert_same(run(path, ids[:i + 1]), step, f"token {i}")


class RealModelReproducibilityTests:
    """The same invariants on real q4_0 models (the weights and sizes users run)."""

    @pytest.mark.parametrize("name, n_tokens", [("smollm2-135m", 100), ("gemma3-270m", 40)])
    def test_batch_threads_and_splits(self, name, n_tokens):
        """Batches 1, 7, 32 and the whole prompt, 1 and 2 threads, one call or two: the same bits."""
        path = real_model(name, "q4_0").mlb
        with Model(path) as model:
            n_vocab = model.n_vocab
        ids = [int(t) for t in np.random.default_rng(2).integers(0, n_vocab, size=n_tokens)]
        expected = run(path, ids, threads=2, batch=32)
        for batch, threads in ((1, 1), (7, 2), (32, 1), (None, 2), (None, 1)):
            assert_same(expected, run(path, ids, threads=threads, batch=batch), f"batch {batch}, {threads} threads")
        assert_same(expected, run(path, ids, threads=2, batch=32, splits=[n_tokens // 2 + 3]), "two calls")
