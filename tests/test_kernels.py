"""The numeric kernels (engine_c/src/kernels/kernels.h) of the library under test ($KRAFLA_LIB).

What is pinned, and against what:
- f16/bf16 conversions: bit for bit against numpy, for all 65536 halves and random floats.
- q8_0 quantization: bit for bit against gguf-py's quantizer (itself bit-exact with ggml's
  quantize_row_q8_0_ref); dequantization against gguf-py's dequantizers.
- The integer block sums of q8_0 x q8_0 and q4_0 x q8_0: exactly against numpy integer sums.
- Matmul, dot, axpy: the reference against numpy in float64 within FLOAT32_SUM_TOLERANCE (below).
- Every AVX2 kernel equals its reference twin. The references follow the AVX2 reduction order,
  so the tolerance here is zero: bit for bit, floats included.
- Reproducibility: matmul outputs are bit for bit the same whatever the number of tokens in the
  call and whatever output-row range a call computes.

ISA: the library must be the one asked for ($KRAFLA_ISA, else the best this CPU runs). A library
built with ISA=generic has only the references: the AVX2-versus-reference tests then skip, each
saying so, and `test_generic_build_has_no_avx2_kernels` checks that the AVX2 entry points refuse to
run rather than quietly running the reference. To test a generic build, run with KRAFLA_ISA=generic.
"""

import ctypes
import os

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import clib, kernels

QUANTIZED = ("q8_0", "q4_0")
FLOAT_TYPES = ("f32", "f16", "bf16")
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
KERNEL_SETTINGS = settings(max_examples=40, deadline=None)


def float32_sum_tolerance(magnitudes, n_terms):
    """FLOAT32_SUM_TOLERANCE: the textbook bound for a float32 sum of n_terms products, n*u*sum|terms|
    with u = 2^-24, taken as 2n*u to cover the per-block scale product and the lane tree; here
    `magnitudes` is sum |w_k x_k| for each output, computed in float64."""
    return 2.0 * n_terms * 2.0**-24 * magnitudes + 1e-30


def avx2_or_skip():
    """The AVX2 implementation's name, or skip: an ISA=generic library has only the references."""
    if not kernels.has_avx2():
        pytest.skip(f"library is ISA={kernels.isa()}: no AVX2 kernels to compare with the references")
    return "avx2"


def same_bits(a, b):
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# Data


def random_float32(rng, shape):
    """Normal values with per-row spread over several orders of magnitude, some exact zeros."""
    values = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
    values[rng.random(shape) < 0.05] = 0.0
    return values.astype(np.float32)


def weights_of(type_name, w):
    """(rows, cols) float32 -> the file layout bytes of type_name, quantized by gguf-py."""
    if type_name in QUANTIZED:
        return gguf_quantize(w, GGUF_TYPES[type_name]).reshape(-1)
    if type_name == "f32":
        return w.view(np.uint8).reshape(-1)
    if type_name == "f16":
        return w.astype(np.float16).view(np.uint8).reshape(-1)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)  # bf16: truncate


def weights_as_float64(type_name, data, rows, cols):
    """The values the weight bytes stand for, decoded by numpy / gguf-py (not by krafla)."""
    if type_name in QUANTIZED:
        return gguf_dequantize(data.reshape(rows, -1), GGUF_TYPES[type_name]).astype(np.float64)
    if type_name == "f32":
        return data.view(np.float32).reshape(rows, cols).astype(np.float64)
    if type_name == "f16":
        return data.view(np.float16).reshape(rows, cols).astype(np.float64)
    return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols).astype(np.float64)


def activations_as_float64(type_name, x):
    """What the matmul multiplies by: x itself for float weights, its q8_0 rounding (by gguf-py) otherwise."""
    if type_name in QUANTIZED:
        q = gguf_quantize(x, gguf.GGMLQuantizationType.Q8_0)
        return gguf_dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape).astype(np.float64)
    return x.astype(np.float64)


@st.composite
def matmul_problems(draw, type_names=QUANTIZED + FLOAT_TYPES):
    """(type, rows, cols, n_tokens, seed) with odd sizes: cols whole blocks for q8_0/q4_0, any for floats."""
    type_name = draw(st.sampled_from(type_names))
    rows = draw(st.integers(1, 13))
    cols = 32 * draw(st.integers(1, 7)) if type_name in QUANTIZED else draw(st.integers(1, 75))
    n_tokens = draw(st.integers(1, 9))
    return type_name, rows, cols, n_tokens, draw(st.integers(0, 2**32 - 1))


def make_problem(type_name, rows, cols, n_tokens, seed):
    rng = np.random.default_rng(seed)
    w = random_float32(rng, (rows, cols))
    x = random_float32(rng, (n_tokens, cols))
    return weights_of(type_name, w), x


# ---------------------------------------------------------------------------------------------


class LibraryTests:
    def test_library_isa_is_the_one_asked_for(self):
        """The library under test was built for $KRAFLA_ISA (else the best ISA of this CPU), so an
        accidental generic build cannot make the AVX2 comparisons skip unnoticed."""
        expected = os.environ.get("KRAFLA_ISA") or clib.cpu_isa()
        allowed = {expected, "avx512"} if expected == "avx2" else {expected}
        assert kernels.isa() in allowed, (
            f"{clib.library_path()} is ISA={kernels.isa()} but {expected} was asked for; "
            "set KRAFLA_ISA to the ISA you mean to test")

    def test_generic_build_has_no_avx2_kernels(self):
        """Asking for the AVX2 version runs it in an avx2 build and is refused in a generic one
        (never silently answered by the reference)."""
        x = np.ones(32, np.float32)
        if kernels.has_avx2():
            assert kernels.quantize_q8_0(x, "avx2").size == 34
        else:
            with pytest.raises(clib.KraflaError, match="ISA=generic"):
                kernels.quantize_q8_0(x, "avx2")

    def test_bad_arguments_are_refused_by_the_c_entry_points(self):
        """The C test entry points check sizes, types, ranges and the implementation number."""
        lib = clib.load()
        error = clib.kr_error()
        x = np.zeros(64, np.float32)
        out = np.zeros(64 * 4, np.uint8)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        assert lib.kr_test_quantize_q8_0(1, ptr(x), ptr(out), 33, ctypes.byref(error)) == 4
        assert "multiple of 32" in error.message.decode()
        assert lib.kr_test_quantize_q8_0(7, ptr(x), ptr(out), 32, ctypes.byref(error)) == 4
        assert "implementation 7" in error.message.decode()
        assert lib.kr_test_dequantize(6, ptr(out), ptr(x), 8, ctypes.byref(error)) == 4
        assert "has no kernels" in error.message.decode()
        result = np.zeros(4, np.float32)
        status = lib.kr_test_matmul(1, 0, ptr(x), 2, 8, ptr(x), 1, ptr(result), 1, 3, ctypes.byref(error))
        assert status == 4 and "row range [1, 3)" in error.message.decode()
        assert lib.kr_test_quantize_q8_0(1, None, ptr(out), 32, ctypes.byref(error)) == 4

    def test_python_wrappers_check_shapes(self):
        """The bindings reject mismatched buffers before calling C."""
        with pytest.raises(ValueError, match="take 36 bytes"):
            kernels.matmul("q4_0", np.zeros(35, np.uint8), 2, 32, np.zeros((1, 32), np.float32))
        with pytest.raises(ValueError, match="unknown weight type"):
            kernels.dequantize("q5_k", b"", 0)


# ---------------------------------------------------------------------------------------------


def numpy_quieted_f16_nan(bits16):
    """F16C (and krafla) keep a NaN's sign and payload and set the quiet bit; numpy keeps
    signalling NaNs as they are. Non-NaN values are compared with numpy directly."""
    return bits16 | np.uint16(0x0200)


class F16Tests:
    @pytest.mark.parametrize("impl", ["dispatch", "reference", "avx2"])
    def test_all_halves_to_f32_match_numpy(self, impl):
        """All 65536 half-precision patterns convert to numpy's float32, bit for bit (NaNs come
        out quiet with their payload)."""
        if impl == "avx2":
            avx2_or_skip()
        halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        expected = halves.view(np.float16).astype(np.float32).view(np.uint32)
        is_nan = np.isnan(halves.view(np.float16))
        expected = np.where(is_nan, expected | np.uint32(0x00400000), expected)
        got = kernels.f16_to_f32(halves, impl).view(np.uint32)
        mismatches = np.flatnonzero(got != expected)
        assert mismatches.size == 0, [hex(h) for h in halves[mismatches[:8]]]

    @pytest.mark.parametrize("impl", ["dispatch", "reference", "avx2"])
    def test_random_floats_to_f16_match_numpy(self, impl):
        """f32 -> f16 rounds to nearest even like numpy on random bit patterns (all exponents:
        overflow, subnormals, NaNs) and on the rounding boundaries."""
        if impl == "avx2":
            avx2_or_skip()
        rng = np.random.default_rng(7)
        bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32)
        # and many near the half range: exponents of halves +- a few, random low mantissa bits
        near = (rng.integers(98, 145, 200_000, dtype=np.uint32) << 23) | rng.integers(0, 2**23, 200_000, dtype=np.uint32)
        near |= rng.integers(0, 2, 200_000, dtype=np.uint32) << 31
        edges = np.array([65504.0, 65519.996, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14,
                          2.0**-14 - 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, -0.0, np.inf, -np.inf], np.float32)
        values = np.concatenate([bits.view(np.float32), near.view(np.float32), edges, -edges])
        with np.errstate(over="ignore", invalid="ignore"):
            expected = values.astype(np.float16).view(np.uint16)
        is_nan = np.isnan(values)
        payload = ((values.view(np.uint32) >> 16) & 0x8000 | 0x7c00 | (values.view(np.uint32) >> 13) & 0x3FF).astype(np.uint16)
        expected = np.where(is_nan, numpy_quieted_f16_nan(payload), expected)
        got = kernels.f32_to_f16(values, impl)
        mismatches = np.flatnonzero(got != expected)
        assert mismatches.size == 0, [(float(values[i]), hex(got[i]), hex(expected[i])) for i in mismatches[:8]]

    def test_bf16_is_the_top_half_of_a_float(self):
        """bf16 weights decode to the float32 whose top 16 bits they are, for every pattern."""
        patterns = np.arange(65536, dtype=np.uint32).astype(np.uint16)
        got = kernels.dequantize("bf16", patterns.view(np.uint8), 65536)
        assert np.array_equal(got.view(np.uint32), patterns.astype(np.uint32) << 16)


# ---------------------------------------------------------------------------------------------


class QuantizeTests:
    @KERNEL_SETTINGS
    @given(n_blocks=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), impl=st.sampled_from(["reference", "avx2"]))
    def test_q8_0_matches_gguf_bit_for_bit(self, n_blocks, seed, impl):
        """quantize_row_q8_0 gives gguf-py's (ggml's reference) bytes exactly: d = amax/127 as f16,
        q = roundf(x / d)."""
        if impl == "avx2":
            avx2_or_skip()
        x = random_float32(np.random.default_rng(seed), (n_blocks, 32))
        expected = gguf_quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
        assert np.array_equal(kernels.quantize_q8_0(x, impl), expected)

    @pytest.mark.parametrize("impl", ["reference", "avx2"])
    def test_q8_0_rounds_ties_away_from_zero(self, impl):
        """With amax 127 the scale is 1, so x = k + 0.5 sits exactly on a tie: roundf goes away
        from zero (not to even, which the AVX rounding modes would do); zeros give d = 0, q = 0."""
        if impl == "avx2":
            avx2_or_skip()
        ties = np.array([127.0] + [k + 0.5 for k in range(-16, 15)], np.float32)
        x = np.concatenate([ties, -ties, np.zeros(32, np.float32)])
        blocks = kernels.quantize_q8_0(x, impl).reshape(3, 34)
        quants = blocks[:, 2:].view(np.int8).astype(np.int32)
        expected = np.trunc(np.abs(ties) + 0.5) * np.sign(ties)
        assert np.array_equal(quants[0], expected)
        assert np.array_equal(quants[1], -expected)
        assert np.array_equal(blocks[:, :2].copy().view(np.float16).reshape(-1), np.float16([1.0, 1.0, 0.0]))
        assert not quants[2].any()

    @KERNEL_SETTINGS
    @given(n_blocks=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
    def test_q8_0_of_non_finite_and_extreme_input_is_defined(self, n_blocks, seed):
        """Beyond what ggml defines: a NaN makes its block's scale NaN (so it propagates) with
        quants in [-127, 127]; infinities, subnormal blocks and floats near the f16 limit quantize
        the same in AVX2 as in the reference, bit for bit."""
        rng = np.random.default_rng(seed)
        x = random_float32(rng, (n_blocks, 32))
        specials = np.array([np.nan, np.inf, -np.inf, 1e-42, -3e38, 7e4], np.float32)
        mask = rng.random(x.shape) < 0.1
        x[mask] = rng.choice(specials, mask.sum())
        x[rng.random(n_blocks) < 0.2] *= np.float32(1e-40)
        reference = kernels.quantize_q8_0(x, "reference").reshape(n_blocks, 34)
        scales = reference[:, :2].copy().view(np.float16).reshape(-1)
        assert np.array_equal(np.isnan(scales), np.isnan(x).any(axis=1))
        assert (reference[:, 2:].view(np.int8) != -128).all()
        if kernels.has_avx2():
            assert np.array_equal(kernels.quantize_q8_0(x, "avx2").reshape(n_blocks, 34), reference)

    @KERNEL_SETTINGS
    @given(type_name=st.sampled_from(QUANTIZED + FLOAT_TYPES), n_blocks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
    def test_dequantize_matches_gguf_and_numpy(self, type_name, n_blocks, seed):
        """One row of each weight type decodes to what gguf-py / numpy decode, bit for bit."""
        rng = np.random.default_rng(seed)
        w = random_float32(rng, (1, 32 * n_blocks))
        data = weights_of(type_name, w)
        expected = weights_as_float64(type_name, data, 1, w.shape[1]).astype(np.float32).reshape(-1)
        assert same_bits(kernels.dequantize(type_name, data, w.shape[1]), expected)


# ---------------------------------------------------------------------------------------------


class BlockSumTests:
    @KERNEL_SETTINGS
    @given(type_name=st.sampled_from(QUANTIZED), rows=st.integers(1, 19), n_blocks=st.integers(1, 12),
           n_tokens=st.integers(1, 6), seed=st.integers(0, 2**32 - 1), extremes=st.booleans())
    def test_integer_block_sums_are_exact(self, type_name, rows, n_blocks, n_tokens, seed, extremes):
        """The integer part of a quantized dot product is exact in every implementation and layout
        (no int16 saturation in maddubs, extreme quants included): with every scale 1, a matmul is
        the exact integer dot product of the quants (all partial sums are below 2^24)."""
        rng = np.random.default_rng(seed)
        cols = 32 * n_blocks
        # integer activations with a 127 in every block quantize to themselves with scale 1
        x = rng.integers(-127, 128, (n_tokens, cols)).astype(np.float32)
        x[:, ::32] = 127 * np.where(rng.random((n_tokens, n_blocks)) < 0.5, -1, 1)
        weights = np.zeros((rows, n_blocks, kernels.BLOCK_BYTES[type_name]), np.uint8)
        weights[:, :, :2] = np.array([1.0], np.float16).view(np.uint8)
        weights[:, :, 2:] = rng.integers(0, 256, weights[:, :, 2:].shape, dtype=np.uint8)
        if extremes:
            weights[:, :, 2:] = 0x80 if type_name == "q8_0" else 0x00  # q8_0 -128, q4_0 nibbles 0 (-8)
            x[:] = -127.0
        quants = weights[:, :, 2:]
        if type_name == "q8_0":
            w = quants.view(np.int8).astype(np.int64).reshape(rows, cols)
        else:
            w = (np.concatenate([quants & 0x0F, quants >> 4], axis=2).astype(np.int64) - 8).reshape(rows, cols)
        expected = (x.astype(np.int64) @ w.T).astype(np.float64)
        weights = weights.reshape(-1)
        packed = kernels.pack(type_name, weights, rows, cols)
        impls = ("reference", "avx2", "dispatch") if kernels.has_avx2() else ("reference", "dispatch")
        for impl in impls:
            assert np.array_equal(kernels.matmul(type_name, weights, rows, cols, x, impl), expected), impl
            assert np.array_equal(kernels.matmul_packed(type_name, packed, rows, cols, x, impl=impl), expected), impl


# ---------------------------------------------------------------------------------------------


class MatmulTests:
    @KERNEL_SETTINGS
    @given(problem=matmul_problems())
    def test_avx2_equals_reference_bit_for_bit(self, problem):
        """For every weight type and odd sizes, the AVX2 matmul (tiled) gives exactly the
        reference's floats."""
        fast = avx2_or_skip()
        type_name, rows, cols, n_tokens, seed = problem
        weights, x = make_problem(*problem)
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, fast), reference)

    @KERNEL_SETTINGS
    @given(problem=matmul_problems())
    def test_reference_matches_numpy_within_tolerance(self, problem):
        """The reference equals W @ x computed by numpy in float64 from gguf-py's decoding of the
        weights (and of the q8_0 activations), within FLOAT32_SUM_TOLERANCE."""
        type_name, rows, cols, n_tokens, seed = problem
        weights, x = make_problem(*problem)
        w64 = weights_as_float64(type_name, weights, rows, cols)
        x64 = activations_as_float64(type_name, x)
        expected = x64 @ w64.T
        tolerance = float32_sum_tolerance(np.abs(x64) @ np.abs(w64).T, cols // 8 + 8)
        for impl in ("reference", "dispatch"):
            got = kernels.matmul(type_name, weights, rows, cols, x, impl)
            assert np.all(np.abs(got - expected) <= tolerance), (impl, np.max(np.abs(got - expected) - tolerance))

    @KERNEL_SETTINGS
    @given(problem=matmul_problems(), data=st.data())
    def test_results_do_not_depend_on_token_count_or_row_range(self, problem, data):
        """The reproducibility invariant: each (token, row) output is bit for bit the same when the
        token is computed alone, in any batch split, or with the rows split at any point."""
        type_name, rows, cols, n_tokens, seed = problem
        weights, x = make_problem(*problem)
        impl = "dispatch"
        whole = kernels.matmul(type_name, weights, rows, cols, x, impl)
        split = data.draw(st.integers(0, n_tokens), label="token split")
        parts = [kernels.matmul(type_name, weights, rows, cols, x[a:b], impl) for a, b in ((0, split), (split, n_tokens))]
        assert same_bits(np.concatenate(parts), whole)
        alone = [kernels.matmul(type_name, weights, rows, cols, x[t:t + 1], impl) for t in range(n_tokens)]
        assert same_bits(np.concatenate(alone), whole)
        cut = data.draw(st.integers(0, rows), label="row split")
        left = kernels.matmul(type_name, weights, rows, cols, x, impl, 0, cut)
        right = kernels.matmul(type_name, weights, rows, cols, x, impl, cut, rows)
        assert same_bits(np.concatenate([left[:, :cut], right[:, cut:]], axis=1), whole)
        assert np.isnan(left[:, cut:]).all() and np.isnan(right[:, :cut]).all()

    @pytest.mark.parametrize("type_name, rows, cols, n_tokens", [
        ("q4_0", 576, 1536, 35), ("q8_0", 576, 1536, 35),
        # enough tokens that the AVX2 matmul takes them in several L2-sized blocks
        ("q4_0", 37, 4864, 53), ("q8_0", 29, 4864, 53), ("f32", 11, 4864, 29), ("f16", 13, 4864, 29)])
    def test_large_shapes_agree(self, type_name, rows, cols, n_tokens):
        """Projection-sized problems: AVX2 equals the reference, and the batch equals each token
        computed alone, also when the tokens are processed in several cache-sized blocks."""
        rng = np.random.default_rng(3)
        x = random_float32(rng, (n_tokens, cols))
        weights = weights_of(type_name, random_float32(rng, (rows, cols)))
        whole = kernels.matmul(type_name, weights, rows, cols, x)
        if kernels.has_avx2():
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, "avx2"), whole)
        assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, "reference"), whole)
        for t in (0, 17, n_tokens - 1):
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x[t:t + 1]), whole[t:t + 1])


# ---------------------------------------------------------------------------------------------


class VectorTests:
    @KERNEL_SETTINGS
    @given(n=st.integers(0, 200), half=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def test_dot(self, n, half, seed):
        """dot(a, b), a f32 or f16: the reference is within FLOAT32_SUM_TOLERANCE of numpy's float64
        dot, and the AVX2 version equals the reference bit for bit."""
        rng = np.random.default_rng(seed)
        a = random_float32(rng, (n,)) if n else np.zeros(0, np.float32)
        b = random_float32(rng, (n,)) if n else np.zeros(0, np.float32)
        if half:
            a = a.astype(np.float16)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        reference = kernels.dot(a, b, "reference")
        assert abs(reference - a64 @ b64) <= float32_sum_tolerance(np.abs(a64) @ np.abs(b64), n // 8 + 8)
        if kernels.has_avx2():
            assert same_bits(kernels.dot(a, b, "avx2"), reference)

    @KERNEL_SETTINGS
    @given(n=st.integers(0, 100), half=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def test_axpy(self, n, half, seed):
        """y + alpha * x is one fused multiply-add per element: within one float32 rounding of the
        float64 result, and the AVX2 version equals the reference bit for bit."""
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(n).astype(np.float32)
        y = rng.standard_normal(n).astype(np.float32)
        if half:
            x = x.astype(np.float16)
        alpha = np.float32(rng.standard_normal())
        exact = np.float64(alpha) * x.astype(np.float64) + y.astype(np.float64)
        reference = kernels.axpy(alpha, x, y, "reference")
        assert np.all(np.abs(reference - exact) <= np.spacing(np.abs(exact).astype(np.float32)))
        if kernels.has_avx2():
            assert same_bits(kernels.axpy(alpha, x, y, "avx2"), reference)

    @KERNEL_SETTINGS
    @given(n=st.integers(1, 140), n_rows=st.integers(0, 11), extra=st.integers(0, 9), half=st.booleans(),
           seed=st.integers(0, 2**32 - 1))
    def test_dot_rows_is_one_dot_per_row(self, n, n_rows, extra, half, seed):
        """kr_dot_rows over a strided KV-cache-like block gives, bit for bit, kr_dot of each row
        (the reference's and the AVX2 one's alike)."""
        rng = np.random.default_rng(seed)
        rows = random_float32(rng, (n_rows, n + extra)) if n_rows else np.zeros((0, n + extra), np.float32)
        rows = rows.astype(np.float16) if half else rows
        x = random_float32(rng, (n,))
        for impl in ("reference", "dispatch") + (("avx2",) if kernels.has_avx2() else ()):
            expected = [kernels.dot(row[:n], x, impl) for row in rows]
            assert same_bits(kernels.dot_rows(rows, x, impl), np.array(expected, np.float32).reshape(n_rows))

    @KERNEL_SETTINGS
    @given(n=st.integers(1, 140), n_rows=st.integers(0, 11), extra=st.integers(0, 9), half=st.booleans(),
           seed=st.integers(0, 2**32 - 1))
    def test_axpy_rows_is_one_axpy_per_row(self, n, n_rows, extra, half, seed):
        """kr_axpy_rows equals, bit for bit, kr_axpy applied row after row, in each implementation."""
        rng = np.random.default_rng(seed)
        rows = rng.standard_normal((n_rows, n + extra)).astype(np.float16 if half else np.float32)
        weights = rng.random(n_rows).astype(np.float32)
        y = rng.standard_normal(n).astype(np.float32)
        for impl in ("reference", "dispatch") + (("avx2",) if kernels.has_avx2() else ()):
            expected = y
            for weight, row in zip(weights, rows):
                expected = kernels.axpy(weight, row[:n], expected, impl)
            assert same_bits(kernels.axpy_rows(weights, rows, y, impl), expected)


# ---------------------------------------------------------------------------------------------

EXP_ULP_TOLERANCE = 2  # krafla's exp is a degree-7 polynomial after range reduction: ~0.9 ulp measured


def lanes_sum_float32(values):
    """The kernels' summation order, in numpy float32: 8 lanes, ((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7)), then the tail."""
    values = np.asarray(values, np.float32)
    n8 = values.size - values.size % 8
    lanes = np.zeros(8, np.float32)
    for start in range(0, n8, 8):
        lanes = lanes + values[start:start + 8]
    total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
    for value in values[n8:]:
        total = np.float32(total + value)
    return np.float32(total)


def same_bits_or_both_nan(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


class ElementwiseTests:
    @pytest.mark.parametrize("impl", ["reference", "avx2"])
    def test_exp_is_within_two_ulp(self, impl):
        """exp over the whole float range that matters (overflow, the subnormals, underflow to 0)
        is within EXP_ULP_TOLERANCE of numpy's float64 exp; inf, -inf and NaN map to inf, 0, NaN."""
        if impl == "avx2":
            avx2_or_skip()
        rng = np.random.default_rng(11)
        x = np.concatenate([rng.uniform(-110, 92, 300_000), rng.uniform(-2, 2, 50_000)]).astype(np.float32)
        exact = np.exp(x.astype(np.float64))
        got = kernels.exp(x, impl)
        away_from_overflow = exact < 3.39e38
        ulp = np.spacing(exact[away_from_overflow].astype(np.float32)).astype(np.float64)
        assert np.max(np.abs(got[away_from_overflow] - exact[away_from_overflow]) / ulp) <= EXP_ULP_TOLERANCE
        assert np.all(np.isinf(got[exact > 3.41e38]))
        specials = kernels.exp(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32), impl)
        assert specials[0] == np.inf and specials[1] == 0 and np.isnan(specials[2]) and (specials[3:] == 1).all()

    @KERNEL_SETTINGS
    @given(values=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0, max_size=70),
           which=st.sampled_from(["exp", "silu_mul", "gelu_tanh_mul", "exp_shift_sum"]))
    def test_avx2_equals_reference(self, values, which):
        """Every element-wise kernel gives the reference's bits in AVX2, any float input (NaN
        positions must agree; a NaN's payload may differ)."""
        fast = avx2_or_skip()
        x = np.array(values, np.float32)
        up = np.linspace(-3, 3, x.size).astype(np.float32)
        if which == "exp":
            assert same_bits_or_both_nan(kernels.exp(x, fast), kernels.exp(x, "reference"))
        elif which == "exp_shift_sum":
            (v1, s1), (v2, s2) = kernels.exp_shift_sum(x, 1.5, fast), kernels.exp_shift_sum(x, 1.5, "reference")
            assert same_bits_or_both_nan(v1, v2) and same_bits_or_both_nan(s1, s2)
        else:
            function = getattr(kernels, which)
            assert same_bits_or_both_nan(function(x, up, fast), function(x, up, "reference"))

    @KERNEL_SETTINGS
    @given(n=st.integers(0, 150), scale=st.floats(0.01, 30), seed=st.integers(0, 2**32 - 1))
    def test_activations_match_numpy(self, n, scale, seed):
        """silu(g) * u and gelu_tanh(g) * u (transformers' tanh approximation) match numpy in
        float64 within 2^-20 of |g u| plus 2^-20 |u|: the exp is within 2 ulp, tanh via
        1 - 2 / (exp(2z) + 1) loses at most that near z = 0."""
        rng = np.random.default_rng(seed)
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        u = rng.standard_normal(n).astype(np.float32)
        g64, u64 = g.astype(np.float64), u.astype(np.float64)
        tolerance = 2.0**-20 * (np.abs(g64 * u64) + np.abs(u64)) + 1e-30
        silu = g64 / (1 + np.exp(-g64)) * u64
        gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u64
        for impl in ("reference", "dispatch"):
            assert np.all(np.abs(kernels.silu_mul(g, u, impl) - silu) <= tolerance)
            assert np.all(np.abs(kernels.gelu_tanh_mul(g, u, impl) - gelu) <= tolerance)

    @KERNEL_SETTINGS
    @given(n=st.integers(0, 150), seed=st.integers(0, 2**32 - 1))
    def test_exp_shift_sum_is_a_softmax_numerator(self, n, seed):
        """exp_shift_sum writes exp(x - shift) (the kernel's exp of the float32 difference) and
        returns their sum in the 8-lane order, reproduced here in numpy float32 bit for bit."""
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal(n) * 10).astype(np.float32)
        shift = np.float32(x.max()) if n else np.float32(0)
        for impl in ("reference", "dispatch"):
            values, total = kernels.exp_shift_sum(x, shift, impl)
            assert same_bits(values, kernels.exp(x - shift, impl))
            assert same_bits(total, lanes_sum_float32(values))


# ---------------------------------------------------------------------------------------------
# DeltaNet (kernels/deltanet.h)


class DeltaRuleTests:
    @KERNEL_SETTINGS
    @given(dk=st.integers(1, 70), dv=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
    def test_delta_rule_matches_numpy_and_every_implementation(self, dk, dv, seed):
        """One token of the gated delta rule on S^T (dv x dk): the reference is within float32
        rounding of numpy's float64 recurrence (S *= decay; delta = (v - S k) * beta; S += delta k;
        out = S q), and the AVX2 version equals the reference bit for bit, state and output, for
        widths with and without a scalar tail."""
        rng = np.random.default_rng(seed)
        state = rng.standard_normal((dv, dk)).astype(np.float32)
        q, k = rng.standard_normal(dk).astype(np.float32), rng.standard_normal(dk).astype(np.float32)
        v = rng.standard_normal(dv).astype(np.float32)
        beta, decay = np.float32(rng.random()), np.float32(rng.uniform(0.3, 1.0))
        s64 = state.astype(np.float64) * np.float64(decay)
        delta = (v.astype(np.float64) - s64 @ k.astype(np.float64)) * np.float64(beta)
        s64 = s64 + np.outer(delta, k.astype(np.float64))
        out64 = s64 @ q.astype(np.float64)
        new_state, out = kernels.delta_rule(state, q, k, v, beta, decay, "reference")
        magnitude = np.abs(s64) @ np.abs(q.astype(np.float64)) + np.abs(delta) * (np.abs(k) @ np.abs(q)) + 1
        assert np.all(np.abs(out - out64) <= 64 * dk * 2.0**-24 * magnitude)
        assert np.allclose(new_state, s64, rtol=1e-5, atol=1e-5 * (1 + np.abs(delta)[:, None]))
        impls = ("dispatch", "avx2") if kernels.has_avx2() else ("dispatch",)
        for impl in impls:
            other_state, other_out = kernels.delta_rule(state, q, k, v, beta, decay, impl)
            assert same_bits(other_state, new_state) and same_bits(other_out, out), impl
