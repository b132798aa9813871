"""Qwen3.5 (arch qwen35) in the C engine: tiny random models written without torch.

The logits are checked against a numpy reference here and against transformers in
tests/reference/test_hf_convert.py (make test-reference). These tests also pin that the state after
a prompt does not depend on the batch size, the thread count or how the prompt is split into
calls (bit for bit), the state can only be dropped or kept, never cut back, and malformed
qwen35 files are refused with a message.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import formats, pack
from krafla_twisted.engine.model import EngineError, Model
from tests.support.tiny_qwen35 import qwen35_container, write_tiny_qwen35

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 89, 45)]
MORE = [5, 17, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "tiny.mlb", seed=1)


def run(path, chunks, *, batch=32, threads=1, kv="f32"):
    """Logits after each chunk of tokens, evaluated in one session."""
    with Model(path, threads=threads) as model:
        session = model.session(batch=batch, kv=kv)
        return [session.eval(chunk).copy() for chunk in chunks]


class Qwen35EngineTests:
    def test_info(self, tiny):
        """The model opens as arch qwen35 with the file's shape."""
        with Model(tiny) as model:
            assert model.info["arch"] == "qwen35"
            assert model.n_vocab == 89

    @pytest.mark.parametrize("batch", [1, 7, 45])
    def test_batch_size_does_not_change_the_state(self, tiny, batch):
        """A prompt in steps of 1, 7 or all 45 tokens gives the bits of steps of 32, and so does the
        next tokens' logits (the conv and delta-rule states are identical too)."""
        expected = run(tiny, [PROMPT, MORE], batch=32)
        got = run(tiny, [PROMPT, MORE], batch=batch)
        for a, b in zip(expected, got):
            assert np.array_equal(a, b)

    def test_threads_do_not_change_the_result(self, tiny):
        """One and two threads give the same bits."""
        for a, b in zip(run(tiny, [PROMPT, MORE], threads=1), run(tiny, [PROMPT, MORE], threads=2)):
            assert np.array_equal(a, b)

    def test_prompt_in_two_calls(self, tiny):
        """A prompt evaluated in two calls equals one call, bit for bit."""
        whole = run(tiny, [PROMPT + MORE])[-1]
        split = run(tiny, [PROMPT[:20], PROMPT[20:] + MORE])[-1]
        assert np.array_equal(whole, split)

    def test_truncate_only_to_zero_or_the_length(self, tiny):
        """The recurrent state cannot be cut back: truncating to 1..n-1 raises and leaves the
        session as it was; truncating to n is a no-op; to 0 starts afresh (same logits as a new
        session)."""
        with Model(tiny) as model:
            session = model.session()
            first = session.eval(PROMPT).copy()
            with pytest.raises(EngineError, match="cannot truncate a qwen35 session to 10 tokens"):
                session.truncate(10)
            assert session.n_tokens == len(PROMPT)
            session.truncate(len(PROMPT))
            after = session.eval(MORE).copy()
            session.truncate(0)
            assert session.n_tokens == 0
            assert np.array_equal(session.eval(PROMPT), first)
            assert np.array_equal(session.eval(MORE), after)

    def test_f16_cache_is_close(self, tiny):
        """An f16 KV cache gives nearly the f32 logits."""
        a, b = run(tiny, [PROMPT])[0], run(tiny, [PROMPT], kv="f16")[0]
        assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.9999

    @pytest.mark.parametrize("weight_type, floor", [("f16", 0.9999), ("q8_0", 0.99)])
    def test_quantized_models_stay_close(self, tmp_path, weight_type, floor):
        """The same random weights stored as f16 / q8_0 give per-position logits close to f32
        (median cosine over 45 positions). Random tiny DeltaNet layers amplify rounding where a
        head's output is near zero (the gated RMSNorm rescales it), so single positions and
        q4_0 can be far off; tests/reference/test_hf_convert.py checks q8_0/q4_0 against
        transformers on the dequantized weights."""
        def each(path):
            with Model(path) as model:
                session = model.session()
                return np.array([session.eval([t]).copy() for t in PROMPT])
        f32 = each(write_tiny_qwen35(tmp_path / "f32.mlb", seed=3))
        other = each(write_tiny_qwen35(tmp_path / "q.mlb", seed=3, weight_type=weight_type))
        cosines = (f32 * other).sum(1) / np.linalg.norm(f32, axis=1) / np.linalg.norm(other, axis=1)
        assert np.median(cosines) > floor

    @pytest.mark.parametrize("weight_type", ["q8_0", "q4_0"])
    def test_packed_weights_give_the_same_bits(self, tmp_path, weight_type):
        """Its q8_0/q4_0 matrices (attention, DeltaNet, MLP, output head) are repacked at load like
        the other architectures', and the logits stay bit for bit those of the file layout, at
        batch 1, 5 and the whole prompt, with one and two threads."""
        path = write_tiny_qwen35(tmp_path / "q.mlb", seed=3, weight_type=weight_type)
        for threads in (1, 2):
            with Model(path, threads=threads, pack=False) as plain, Model(path, threads=threads, pack=True) as packed:
                assert pack.status(plain)[0] == pack.NOT_PACKED and pack.status(packed)[0] == pack.PACKED_IN_MEMORY, pack.status(packed)
                for batch in (1, 5, len(PROMPT)):
                    with plain.session(batch=batch) as a, packed.session(batch=batch) as b:
                        assert a.eval(PROMPT).tobytes() == b.eval(PROMPT).tobytes()

    def test_only_full_attention_or_only_linear_layers(self, tmp_path):
        """Layer patterns other than 3+1 run too, and differ from each other."""
        all_linear = run(write_tiny_qwen35(tmp_path / "a.mlb", seed=2, n_layers=2, layer_types=[2, 2]), [PROMPT])[0]
        all_full = run(write_tiny_qwen35(tmp_path / "b.mlb", seed=2, n_layers=2, layer_types=[0, 0]), [PROMPT])[0]
        assert np.isfinite(all_linear).all() and np.isfinite(all_full).all()
        assert not np.array_equal(all_linear, all_full)

    @pytest.mark.parametrize("edit, message", [
        (lambda c: c.metadata.pop("linear_k_heads"), "metadata linear_k_heads is missing"),
        (lambda c: c.metadata.update(layer_types=[2, 1, 2, 0]), r"layer_types\[1\] = 1"),
        (lambda c: c.metadata.update(layer_types=[2, 2]), "layer_types has 2 entries for 4 layers"),
        (lambda c: c.metadata.pop("layer_types"), "qwen35 needs layer_types, one integer per layer"),
        (lambda c: c.tensors.pop("blk.0.ssm_a"), "tensor blk.0.ssm_a"),
        (lambda c: c.tensors.pop("blk.3.attn_q_norm.weight"), "tensor blk.3.attn_q_norm.weight"),
        (lambda c: c.metadata.update(linear_v_heads=3), "do not fit"),
    ])
    def test_bad_files(self, tmp_path, edit, message):
        """Missing keys or tensors and inconsistent layer types or heads: EngineError naming the problem."""
        container = qwen35_container(seed=0)
        edit(container)
        path = tmp_path / "bad.mlb"
        formats.write(path, container)
        with pytest.raises(EngineError, match=message):
            Model(path)


SHAPES = {
    "released-pattern": {},
    "full-first-one-kv-head": dict(n_layers=2, layer_types=[0, 2], n_kv_heads=1, linear_k_heads=2, linear_v_heads=2,
                                   linear_conv_kernel=3, rope_dims=16, tied_embeddings=0),
    "three-values-per-key": dict(n_layers=3, layer_types=[2, 0, 2], linear_k_heads=1, linear_v_heads=3,
                                 linear_k_head_dim=32, linear_v_head_dim=16, rope_dims=8),
}


class Qwen35ReferenceTests:
    """The C engine against the numpy reference (tests/support/reference_qwen35.py), which is
    written from transformers' formulas independently of the C code."""

    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_every_position_matches_the_reference(self, tmp_path, shape):
        """Logits at every position (token by token): same argmax, cosine >= 0.9999 at f32."""
        from tests.support.reference_qwen35 import ReferenceQwen35

        path = write_tiny_qwen35(tmp_path / "m.mlb", seed=9, **SHAPES[shape])
        expected = ReferenceQwen35(path).forward(PROMPT[:30])
        with Model(path) as model:
            session = model.session(batch=8)
            for token, row in zip(PROMPT[:30], expected):
                got = session.eval([token]).astype(np.float64)
                assert int(np.argmax(got)) == int(np.argmax(row))
                assert float(got @ row / np.linalg.norm(got) / np.linalg.norm(row)) >= 0.9999

    def test_quantized_file_against_the_reference_on_its_own_weights(self, tmp_path):
        """A q8_0 file against the reference running the same (dequantized) weights: the engine
        only adds q8_0 activations, median cosine over the positions >= 0.99 (0.997 here)."""
        from tests.support.reference_qwen35 import ReferenceQwen35

        path = write_tiny_qwen35(tmp_path / "q.mlb", seed=9, weight_type="q8_0")
        expected = ReferenceQwen35(path).forward(PROMPT[:30])
        with Model(path) as model:
            session = model.session()
            got = np.array([session.eval([t]).astype(np.float64) for t in PROMPT[:30]])
        cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
        assert np.median(cosines) >= 0.99


@st.composite
def qwen35_shapes(draw):
    """Small qwen35 shapes: head counts and widths, conv width, partial rope, layer patterns."""
    n_kv_heads = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    linear_k_heads = draw(st.integers(1, 3))
    n_layers = draw(st.integers(1, 4))
    return dict(
        dim=draw(st.sampled_from([32, 64])), n_layers=n_layers,
        layer_types=draw(st.lists(st.sampled_from([0, 2]), min_size=n_layers, max_size=n_layers)),
        n_heads=n_kv_heads * draw(st.integers(1, 3)), n_kv_heads=n_kv_heads, head_dim=head_dim,
        rope_dims=draw(st.sampled_from([d for d in (2, 4, 8, 16, 32) if d <= head_dim])),
        ffn_dim=draw(st.sampled_from([32, 64, 96])), linear_conv_kernel=draw(st.integers(1, 5)),
        linear_k_heads=linear_k_heads, linear_v_heads=linear_k_heads * draw(st.integers(1, 3)),
        linear_k_head_dim=draw(st.sampled_from([4, 8, 16, 24])), linear_v_head_dim=draw(st.sampled_from([4, 8, 16])),
        tied_embeddings=draw(st.integers(0, 1)))


class Qwen35ShapeTests:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(shape=qwen35_shapes(), length=st.integers(1, 12), batch=st.integers(1, 5), seed=st.integers(0, 1000))
    def test_hypothesis_shapes_match_the_reference(self, tmp_path, shape, length, batch, seed):
        """Any small shape: the last position's logits match the numpy reference (same argmax up to
        float32 near-ties, cosine >= 0.9999), whatever the batch size."""
        from tests.support.reference_qwen35 import ReferenceQwen35

        path = write_tiny_qwen35(tmp_path / f"h{seed}.mlb", seed=seed, **shape)
        ids = PROMPT[:length]
        expected = ReferenceQwen35(path).forward(ids)[-1]
        with Model(path) as model:
            got = model.session(batch=batch).eval(ids).astype(np.float64)
        # the same argmax, unless the reference's top two are a near-tie float32 cannot order
        assert expected[int(np.argmax(got))] >= expected.max() - 1e-4 * np.abs(expected).max()
        assert float(got @ expected / np.linalg.norm(got) / np.linalg.norm(expected)) >= 0.9999
