"""KV cache q8_0: each position's key and value head rows quantized to q8_0 (ggml's rounding).

Pinned here: the attention kernel over q8_0 value rows (AVX2 equals the reference bit for bit,
the reference equals a float64 numpy sum of the dequantized rows within the float32 bound); the
engine's logits with kv="q8_0" against the numpy reference (f32 everywhere) within
KV_Q8_0_COSINE, the same argmax; bitwise reproducibility over batch sizes, threads and split
prompts; a clear refusal for heads that are not whole q8_0 blocks.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from hypothesis import given, settings, strategies as st

from krafla_twisted.engine import kernels
from krafla_twisted.engine.model import EngineError, Model
from tests.support.reference import ReferenceModel
from tests.support.tiny_models import write_tiny_model, write_tiny_models
from tests.test_kernels import avx2_or_skip, float32_sum_tolerance, same_bits

# The engine with a q8_0 KV cache against the f32 reference: 8-bit keys and values (relative
# error up to 1/254 per value, per block of 32) move the last token's logits by well under 1%:
# cosine similarity at least this.
KV_Q8_0_COSINE = 0.999

Q8 = GGMLQuantizationType.Q8_0


def q8_rows(rng, n_rows, n):
    values = (rng.standard_normal((n_rows, n)) * np.exp(rng.uniform(-3, 3, (n_rows, 1)))).astype(np.float32)
    return gguf_quantize(values, Q8).reshape(n_rows, -1)


class KVRowKernelTests:
    @given(n_blocks=st.integers(1, 8), n_rows=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    @settings(max_examples=60, deadline=None)
    def test_avx2_equals_reference_bit_for_bit(self, n_blocks, n_rows, seed):
        """The AVX2 q8_0 row accumulation performs the reference's operations: the same bits."""
        fast = avx2_or_skip()
        rng = np.random.default_rng(seed)
        blocks = q8_rows(rng, n_rows, 32 * n_blocks)
        weights = rng.random(n_rows).astype(np.float32)
        y = rng.standard_normal(32 * n_blocks).astype(np.float32)
        assert same_bits(kernels.axpy_rows_q8_0(weights, blocks, y, impl=fast),
                         kernels.axpy_rows_q8_0(weights, blocks, y, impl="reference"))

    @given(n_blocks=st.integers(1, 8), n_rows=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
    @settings(max_examples=60, deadline=None)
    def test_reference_is_the_weighted_sum_of_gguf_dequantized_rows(self, n_blocks, n_rows, seed):
        """y + sum_i w_i * row_i with the rows dequantized by gguf-py, within the float32 sum bound."""
        rng = np.random.default_rng(seed)
        blocks = q8_rows(rng, n_rows, 32 * n_blocks)
        weights = rng.random(n_rows).astype(np.float32)
        y = rng.standard_normal(32 * n_blocks).astype(np.float32)
        rows = gguf_dequantize(blocks, Q8).astype(np.float64).reshape(n_rows, -1)
        want = y + weights.astype(np.float64) @ rows
        magnitude = np.abs(y) + np.abs(weights.astype(np.float64)) @ np.abs(rows)
        got = kernels.axpy_rows_q8_0(weights, blocks, y, impl="reference")
        assert (np.abs(got - want) <= float32_sum_tolerance(magnitude, n_rows + 1)).all()

    def test_partial_blocks_are_refused(self):
        with pytest.raises(Exception, match="whole blocks"):
            kernels.axpy_rows_q8_0(np.ones(1, np.float32), np.zeros((1, 34), np.uint8), np.zeros(20, np.float32))


PROMPT = [5, 9, 2, 33, 17, 8, 21, 40, 3, 11, 60, 7, 14, 27, 1, 50, 19, 30]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_tiny_models(tmp_path_factory.mktemp("kvq8"), ("f32", "q4_0"), seed=11, head_dim=32)


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


class KVQ8EngineTests:
    @pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
    def test_logits_match_the_reference_within_tolerance(self, models, arch):
        """f32 weights, q8_0 cache: every prefix's last logits are within KV_Q8_0_COSINE of the numpy
        reference (which keeps keys and values in f32), with the same argmax."""
        path = models[arch, "f32"]
        want = ReferenceModel(path).forward(PROMPT)
        with Model(path, threads=2) as model, model.session(ctx=64, kv="q8_0", batch=4) as session:
            for i, token in enumerate(PROMPT):
                got = session.eval([token])
                assert cosine(got, want[i]) >= KV_Q8_0_COSINE, i
                assert int(np.argmax(got)) == int(np.argmax(want[i])), i

    @pytest.mark.parametrize("arch", ["llama", "gemma3"])
    def test_bitwise_reproducible_over_batch_threads_and_splits(self, models, arch):
        """kv="q8_0" keeps the engine's invariant: the same bits for batch 1, 7 and the whole prompt,
        for 1 and 2 threads, and for the prompt evaluated in two calls."""
        path = models[arch, "q4_0"]
        results = []
        for threads in (1, 2):
            with Model(path, threads=threads) as model:
                for batch in (1, 7, len(PROMPT)):
                    with model.session(ctx=64, kv="q8_0", batch=batch) as session:
                        results.append(session.eval(PROMPT))
                with model.session(ctx=64, kv="q8_0", batch=5) as session:
                    session.eval(PROMPT[:8])
                    results.append(session.eval(PROMPT[8:]))
        for other in results[1:]:
            assert same_bits(results[0], other)

    def test_truncate_and_reuse_gives_the_same_bits(self, models):
        """Truncating a q8_0 cache and evaluating a new suffix equals a fresh evaluation."""
        path = models["qwen2", "q4_0"]
        with Model(path, threads=2) as model, model.session(ctx=64, kv="q8_0", batch=8) as session:
            session.eval(PROMPT)
            session.truncate(6)
            reused = session.eval([4, 44, 12])
            session.truncate(0)
            fresh = session.eval(PROMPT[:6] + [4, 44, 12])
        assert same_bits(reused, fresh)

    def test_heads_of_partial_blocks_are_refused(self, tmp_path):
        """head_dim 16 is not a whole q8_0 block: a clear error names the need, nothing crashes."""
        path = tmp_path / "llama.mlb"
        write_tiny_model(path, "llama", seed=1, head_dim=16)
        with Model(path) as model:
            with pytest.raises(EngineError, match="multiple of 32"):
                model.session(ctx=16, kv="q8_0")
