"""The k-quant kernels (q4_K, q5_K, q6_K weights against q8_K activations; kernels.h, "k-quants").

What is pinned, and against what:
- q8_K quantization: bit for bit against a numpy rendering of ggml's quantize_row_q8_K_ref
  (tests/support/kquants.py), in every implementation.
- Dequantization: bit for bit against gguf-py's numpy dequantizers.
- The reference matmul: against numpy in float64 (gguf-py's decoding of the weights times the
  q8_K activations' values) within FLOAT32_SUM_TOLERANCE.
- The AVX2 (and, in an ISA=avx512 build, VNNI) matmul, file and packed layout, equals the
  reference at zero tolerance, for any number of tokens and any output-row range; the integer
  sums stay exact at the largest quants, scales and activations.
- The packed layout: byte for byte against a numpy construction of its description.
- The published Q4_K_M files' own q4_K and q6_K matrices: the same, on real blocks.
"""

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import clib, kernels
from tests.strategies import kquant_problems
from tests.support import kquants
from tests.test_kernels import avx2_or_skip, float32_sum_tolerance, random_float32, same_bits

GGUF_TYPES = {"q4_K": GGMLQuantizationType.Q4_K, "q5_K": GGMLQuantizationType.Q5_K, "q6_K": GGMLQuantizationType.Q6_K}
KQUANT_SETTINGS = settings(max_examples=30, deadline=None)
IMPLEMENTATIONS = ("reference", "avx2", "dispatch")


def implementations():
    """The implementations this library has (an ISA=generic build has no AVX2 kernels)."""
    return IMPLEMENTATIONS if kernels.has_avx2() else ("reference", "dispatch")


def make_weights(type_name, rows, cols, seed, encoded):
    """Weight bytes (rows, row bytes): random blocks, or random floats encoded by tests/support/kquants."""
    rng = np.random.default_rng(seed)
    if encoded:
        return kquants.encode(random_float32(rng, (rows, cols)), type_name)
    return kquants.random_blocks(rng, type_name, rows, cols)


def activations(cols, n_tokens, seed):
    return random_float32(np.random.default_rng(seed + 1), (n_tokens, cols))


def q8_K_values(x):
    """The values q8_K activations stand for (d * q), by the numpy rendering of ggml's quantizer."""
    d, q, _ = kquants.quantize_q8_K(x)
    return (d.astype(np.float64)[:, None] * q.astype(np.float64)).reshape(x.shape)


class Q8KQuantizeTests:
    @KQUANT_SETTINGS
    @given(n_blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), spread=st.booleans())
    def test_matches_numpy_rendering_of_ggml(self, n_blocks, seed, spread):
        """d, the quants and the sums of 16 equal ggml's quantize_row_q8_K_ref (in numpy) bit for bit,
        in every implementation, including blocks of zeros and ties at half."""
        rng = np.random.default_rng(seed)
        x = random_float32(rng, (n_blocks, 256)) if spread else rng.integers(-40, 41, (n_blocks, 256)).astype(np.float32) / 4
        x[rng.random(n_blocks) < 0.2] = 0.0
        d, q, bsums = kquants.quantize_q8_K(x)
        for impl in implementations():
            got = kernels.quantize_q8_K(x, impl)
            assert same_bits(got["d"], d), impl
            assert np.array_equal(got["q"], q), impl
            assert np.array_equal(got["bsums"], bsums), impl

    @pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf, 1e-40, 3e38])
    def test_non_finite_and_extreme_input_is_defined_the_same_everywhere(self, special):
        """Beyond ggml (finite input only): a NaN makes d NaN, inf and subnormal blocks give clamped
        quants, and every implementation gives the same bytes."""
        x = np.linspace(-1, 1, 512, dtype=np.float32)
        x[3] = special
        x[300] = special
        blocks = [kernels.quantize_q8_K(x, impl) for impl in implementations()]
        for other in blocks[1:]:
            assert blocks[0].tobytes() == other.tobytes()
        assert np.all(np.abs(blocks[0]["q"].astype(int)) <= 127)
        if np.isnan(special):
            assert np.isnan(blocks[0]["d"]).all()

    def test_bad_sizes_are_refused(self):
        """Lengths that are not whole super-blocks of 256 are refused with a message: by the C entry
        points (quantizer, matmul, dequantizer) and by the Python bindings before calling C."""
        lib = clib.load()
        error = clib.kr_error()
        x = np.zeros(512, np.float32)
        out = np.zeros(4096, np.uint8)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        assert lib.kr_test_quantize_q8_K(1, ptr(x), ptr(out), 288, ctypes.byref(error)) == 4
        assert "multiple of 256" in error.message.decode()
        assert lib.kr_test_dequantize(kernels.WEIGHT_TYPES["q6_K"], ptr(out), ptr(x), 160, ctypes.byref(error)) == 4
        assert "multiple of 256" in error.message.decode()
        result = np.zeros(4, np.float32)
        status = lib.kr_test_matmul(1, kernels.WEIGHT_TYPES["q4_K"], ptr(out), 1, 288, ptr(x), 1, ptr(result), 0, 1,
                                    ctypes.byref(error))
        assert status == 4 and "multiple of 256" in error.message.decode()
        with pytest.raises(ValueError, match="256"):
            kernels.quantize_q8_K(np.zeros(100, np.float32))
        with pytest.raises(ValueError, match="multiple of 256 columns"):
            kernels.matmul("q5_K", np.zeros(176, np.uint8), 1, 288, np.zeros((1, 288), np.float32))


class KQuantDequantizeTests:
    @KQUANT_SETTINGS
    @given(type_name=st.sampled_from(kernels.KQUANTS), n_blocks=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
    def test_matches_gguf_bit_for_bit(self, type_name, n_blocks, seed):
        """kr_dequantize_row gives gguf-py's dequantized values exactly (both take the scale and min
        products in float first)."""
        data = kquants.random_blocks(np.random.default_rng(seed), type_name, 1, 256 * n_blocks)
        expected = gguf_dequantize(data.reshape(n_blocks, -1), GGUF_TYPES[type_name]).reshape(-1).astype(np.float32)
        assert same_bits(kernels.dequantize(type_name, data.reshape(-1), 256 * n_blocks), expected)

    @pytest.mark.parametrize("type_name", kernels.KQUANTS)
    def test_encoder_follows_the_weights(self, type_name):
        """The test encoder (tests/support/kquants.encode) writes blocks whose values are close to the
        weights, so tiny models in k-quants behave like their float originals."""
        w = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32)
        data = kquants.encode(w, type_name)
        values = gguf_dequantize(data, GGUF_TYPES[type_name]).reshape(w.shape)
        assert np.abs(values - w).mean() < {"q4_K": 0.1, "q5_K": 0.05, "q6_K": 0.03}[type_name]


class KQuantMatmulTests:
    @KQUANT_SETTINGS
    @given(problem=kquant_problems())
    def test_every_implementation_equals_the_reference(self, problem):
        """File layout and packed layout, every implementation, any row range: the reference's bits."""
        type_name, rows, cols, n_tokens, row_begin, row_end, seed, encoded = problem
        weights = make_weights(type_name, rows, cols, seed, encoded)
        x = activations(cols, n_tokens, seed)
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference", row_begin, row_end)
        packed = kernels.pack(type_name, weights, rows, cols)
        for impl in implementations():
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl, row_begin, row_end), reference), impl
            assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl, row_begin, row_end), reference), impl

    @KQUANT_SETTINGS
    @given(problem=kquant_problems(), data=st.data())
    def test_results_do_not_depend_on_token_count_or_row_range(self, problem, data):
        """Each (token, row) output is the same bits alone, in any batch split, with rows split anywhere."""
        type_name, rows, cols, n_tokens, _, _, seed, encoded = problem
        weights = kernels.pack(type_name, make_weights(type_name, rows, cols, seed, encoded), rows, cols)
        x = activations(cols, n_tokens, seed)
        whole = kernels.matmul_packed(type_name, weights, rows, cols, x)
        alone = [kernels.matmul_packed(type_name, weights, rows, cols, x[t:t + 1]) for t in range(n_tokens)]
        assert same_bits(np.concatenate(alone), whole)
        cut = data.draw(st.integers(0, rows), label="row split")
        left = kernels.matmul_packed(type_name, weights, rows, cols, x, "dispatch", 0, cut)
        right = kernels.matmul_packed(type_name, weights, rows, cols, x, "dispatch", cut, rows)
        assert same_bits(np.concatenate([left[:, :cut], right[:, cut:]], axis=1), whole)

    @KQUANT_SETTINGS
    @given(problem=kquant_problems())
    def test_reference_matches_numpy_within_tolerance(self, problem):
        """The reference equals W @ x in float64 from gguf-py's decoding of the weights and the q8_K
        values of x, within FLOAT32_SUM_TOLERANCE over the super-blocks' terms."""
        type_name, rows, cols, n_tokens, _, _, seed, encoded = problem
        weights = make_weights(type_name, rows, cols, seed, encoded)
        x = activations(cols, n_tokens, seed)
        w64 = gguf_dequantize(weights, GGUF_TYPES[type_name]).reshape(rows, cols).astype(np.float64)
        x64 = q8_K_values(x)
        expected = x64 @ w64.T
        # per super-block: the products' rounding (weights and activation scales) and two fused adds
        tolerance = float32_sum_tolerance(np.abs(x64) @ np.abs(w64).T, 2 * (cols // 256) + 8)
        got = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        assert np.all(np.abs(got - expected) <= tolerance), np.max(np.abs(got - expected) - tolerance)

    @pytest.mark.parametrize("type_name", kernels.KQUANTS)
    def test_integer_sums_stay_exact_at_the_extremes(self, type_name):
        """Every quant, scale and min at its largest against activations of +-127: the AVX2 int16
        steps must not overflow (the reference's integer sums are int32), so all agree."""
        rows, cols = 16, 512
        weights = kquants.random_blocks(np.random.default_rng(1), type_name, rows, cols, extremes=True)
        x = np.where(np.random.default_rng(2).random((3, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
        x[1] = 1.0
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        packed = kernels.pack(type_name, weights, rows, cols)
        for impl in implementations():
            assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl), reference), impl
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl), reference), impl

    @pytest.mark.parametrize("type_name, rows, cols, n_tokens", [
        ("q4_K", 61, 4864, 37), ("q4_K", 45, 8960, 37), ("q5_K", 27, 1536, 70), ("q6_K", 43, 2304, 37)])
    def test_large_shapes_agree(self, type_name, rows, cols, n_tokens):
        """Projection-sized problems, tokens in several cache-sized blocks: every implementation,
        packed or not, equals the reference, and the batch equals a token alone."""
        weights = kquants.random_blocks(np.random.default_rng(3), type_name, rows, cols)
        x = activations(cols, n_tokens, 3)
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        packed = kernels.pack(type_name, weights, rows, cols)
        for impl in implementations():
            assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl), reference), impl
        assert same_bits(kernels.matmul(type_name, weights, rows, cols, x), reference)
        for t in (0, n_tokens - 1):
            assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x[t:t + 1]), reference[t:t + 1])


class KQuantPackTests:
    @KQUANT_SETTINGS
    @given(problem=kquant_problems())
    def test_layout_matches_the_documented_one(self, problem):
        """kr_pack_rows writes, byte for byte, the layout kernels.h / kquant_ref.c describe (built here
        with numpy), at the file layout's size."""
        type_name, rows, cols, _, _, _, seed, encoded = problem
        weights = make_weights(type_name, rows, cols, seed, encoded)
        packed = kernels.pack(type_name, weights, rows, cols)
        assert np.array_equal(packed.reshape(-1), kquants.packed(type_name, weights, rows, cols))


class KQuantModelFileTests:
    def test_tensor_whose_rows_are_not_whole_super_blocks_is_refused(self, tmp_path, monkeypatch):
        """A q4_K matrix whose last dimension is not a multiple of 256 (ggml falls back to other
        types there) is refused when the file is opened, naming the tensor and the block, with no
        crash. formats.py would not write one, so its size check is bypassed for this file."""
        from krafla_twisted.engine import formats
        from krafla_twisted.engine.model import Model
        from tests.support.tiny_models import tiny_model_container

        container = tiny_model_container("llama", seed=1, weight_type="q4_K", tied_embeddings=0)
        container.tensors.pop("blk.0.attn_k.weight")
        monkeypatch.setattr(formats.TensorType, "nbytes", lambda self, shape: int(np.prod(shape)) // self.block * self.block_bytes)
        container.add("blk.0.attn_k.weight", formats.Q4_K, (256, 128), np.zeros(128 * 144, np.uint8))
        path = tmp_path / "bad.mlb"
        formats.write(path, container)
        monkeypatch.undo()
        with pytest.raises(clib.KraflaError, match=r"blk.0.attn_k.weight.*128 is not a multiple of q4_K's block of 256"):
            Model(path)


class RealWeightTests:
    @pytest.mark.parametrize("name, tensors", [
        ("qwen2.5-coder-0.5b", ("blk.0.ffn_down.weight", "blk.5.ffn_down.weight")),
        ("gemma3-270m", ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"))])
    def test_published_k_quant_matrices(self, name, tensors):
        """The published Q4_K_M files' own q4_K and q6_K matrices (blocks as ggml wrote them): every
        implementation, packed or not, equals the reference bit for bit, and the reference equals
        float64 numpy (gguf-py's dequantization, the q8_K values of x) within FLOAT32_SUM_TOLERANCE."""
        from tests.support.real_models import gguf_reader

        found = {t.name: t for t in gguf_reader(name).tensors if t.name in tensors}
        assert sorted(found) == sorted(tensors)
        for tensor in found.values():
            type_name = {"Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K"}[tensor.tensor_type.name]
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
            weights = np.asarray(tensor.data).reshape(-1).view(np.uint8)
            x = activations(cols, 5, 0)
            reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
            packed = kernels.pack(type_name, weights, rows, cols)
            for impl in implementations():
                assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl), reference), (tensor.name, impl)
                assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl), reference), (tensor.name, impl)
            w64 = gguf_dequantize(weights.reshape(rows, -1), tensor.tensor_type).astype(np.float64)
            x64 = q8_K_values(x)
            tolerance = float32_sum_tolerance(np.abs(x64) @ np.abs(w64).T, 2 * (cols // 256) + 8)
            assert np.all(np.abs(reference - x64 @ w64.T) <= tolerance), tensor.name
