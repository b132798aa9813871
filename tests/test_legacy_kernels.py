"""The q4_1, q5_0 and q5_1 kernels (engine_c/src/kernels/legacy.h) of the library under test.

What is pinned, and against what:
- Dequantization (the embedding lookup): bit for bit gguf-py's dequantizers, on quantized weights
  and on random blocks (every bit pattern of quants and fifth bits).
- The reference matmul against float64 numpy on the same blocks and the same q8_0-rounded
  activations, within LEGACY_SUM_TOLERANCE (below).
- Every AVX2 tile (and, in an ISA=avx512 library, the VNNI and 512-bit ones) equals the reference
  bit for bit, file layout and packed, for any row range and token count; the worst case of the
  integer sums (every quant at its largest, activations at +-127) included.
- The packed layout byte for byte against a numpy construction of legacy.h's description.
- Tiny models of each type: the engine against the numpy reference, packed against unpacked, and
  every batch size and thread count giving the same bits.
"""

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import kernels, pack
from krafla_twisted.engine.model import Model
from tests import strategies
from tests.support.reference import ReferenceModel
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.test_kernels import avx2_or_skip, random_float32, same_bits

LEGACY_TYPES = strategies.LEGACY_TYPES
GGUF_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q5_0": gguf.GGMLQuantizationType.Q5_0,
              "q5_1": gguf.GGMLQuantizationType.Q5_1}
BLOCK_BYTES = {"q4_1": 20, "q5_0": 22, "q5_1": 24}
HAS_MIN = {"q4_1": True, "q5_0": False, "q5_1": True}
HAS_FIFTH = {"q4_1": False, "q5_0": True, "q5_1": True}
PACK_ROWS = 8
SETTINGS = settings(max_examples=40, deadline=None)


def legacy_sum_tolerance(magnitudes, n_blocks):
    """LEGACY_SUM_TOLERANCE: each block adds its term(s) with one or two fused multiply-adds (the
    scale products and integer sums are exact), and each rounds by at most u = 2^-24 of the sum so
    far, itself at most `magnitudes` = sum over the row of |d q x| + |m x| (float64). So the error
    is at most 2 * n_blocks * u * magnitudes; the tolerance is twice that."""
    return 4.0 * n_blocks * 2.0**-24 * magnitudes + 1e-30


# ---------------------------------------------------------------------------------------------
# Blocks, made and read with numpy from ggml's layouts (not by krafla)


def f16_bytes(values):
    return np.asarray(values, np.float32).astype("<f2").view(np.uint8).reshape(len(values), 2)


def make_blocks(rng, type_name, n_blocks, extreme=False):
    """n_blocks raw blocks: random scales and minimums (normal, spread over orders of magnitude),
    random quant bits, or (extreme) every quant bit set."""
    scales = rng.standard_normal(n_blocks) * np.exp(rng.uniform(-8, 2, n_blocks))
    mins = rng.standard_normal(n_blocks) * np.exp(rng.uniform(-8, 3, n_blocks))
    parts = [f16_bytes(scales)]
    if HAS_MIN[type_name]:
        parts.append(f16_bytes(mins))
    quant_bytes = 20 if HAS_FIFTH[type_name] else 16
    if extreme:
        parts.append(np.full((n_blocks, quant_bytes), 0xFF, np.uint8))
    else:
        parts.append(rng.integers(0, 256, (n_blocks, quant_bytes), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)


def decode(type_name, data, rows, cols):
    """(scale, minimum, quants): float64 (rows, n_blocks) twice and int64 (rows, cols), the signed
    quant q - 16 for q5_0 and the unsigned one otherwise."""
    size = BLOCK_BYTES[type_name]
    blocks = np.asarray(data, np.uint8).reshape(rows * (cols // 32), size)
    scale = blocks[:, 0:2].copy().view("<f2")[:, 0].astype(np.float64)
    minimum = blocks[:, 2:4].copy().view("<f2")[:, 0].astype(np.float64) if HAS_MIN[type_name] else 0 * scale
    nibbles = blocks[:, size - 16:]
    quants = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.int64)
    if HAS_FIFTH[type_name]:
        fifth = blocks[:, size - 20:size - 16].copy().view("<u4").astype(np.int64)
        quants |= ((fifth >> np.arange(32)) & 1) << 4
    if type_name == "q5_0":
        quants -= 16
    n_blocks = cols // 32
    return scale.reshape(rows, n_blocks), minimum.reshape(rows, n_blocks), quants.reshape(rows, cols)


def make_problem(type_name, rows, cols, n_tokens, kind, seed):
    """(weights as raw bytes, activations float32 (n_tokens, cols)) for one of the strategy's kinds."""
    rng = np.random.default_rng(seed)
    if kind == "quantized":
        weights = gguf_quantize(random_float32(rng, (rows, cols)), GGUF_TYPES[type_name]).reshape(-1)
    else:
        weights = make_blocks(rng, type_name, rows * cols // 32, extreme=kind == "extreme")
    if kind == "extreme":
        signs = np.where(rng.random((n_tokens, 1)) < 0.5, -1.0, 1.0)
        x = np.repeat(signs * np.exp(rng.uniform(-4, 4, (n_tokens, 1))), cols, axis=1).astype(np.float32)
    else:
        x = random_float32(rng, (n_tokens, cols))
    return weights, x


def q8_activations(x):
    """x rounded to q8_0 blocks by gguf-py (the quants and scales krafla's prepared blocks hold)."""
    q = gguf_quantize(x, gguf.GGMLQuantizationType.Q8_0)
    return gguf_dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape).astype(np.float64)


# ---------------------------------------------------------------------------------------------


class LegacyDequantizeTests:
    @given(type_name=st.sampled_from(LEGACY_TYPES), n_blocks=st.integers(1, 9), random_bits=st.booleans(),
           seed=st.integers(0, 2**32 - 1))
    @SETTINGS
    def test_dequantize_equals_gguf_py(self, type_name, n_blocks, random_bits, seed):
        """kr_dequantize_row gives gguf-py's float32 values bit for bit (d * q + m rounded twice, as
        ggml), for quantized weights and for random blocks."""
        rng = np.random.default_rng(seed)
        if random_bits:
            data = make_blocks(rng, type_name, n_blocks)
        else:
            data = gguf_quantize(random_float32(rng, (1, 32 * n_blocks)), GGUF_TYPES[type_name]).reshape(-1)
        expected = gguf_dequantize(data.reshape(n_blocks, -1), GGUF_TYPES[type_name]).reshape(-1)
        assert same_bits(kernels.dequantize(type_name, data, 32 * n_blocks), expected)

    @pytest.mark.parametrize("type_name", LEGACY_TYPES)
    def test_a_row_must_be_whole_blocks(self, type_name):
        """A q4_1/q5_0/q5_1 row of 40 weights is refused (not whole blocks of 32)."""
        with pytest.raises(ValueError, match="multiple of 32"):
            kernels.dequantize(type_name, np.zeros(BLOCK_BYTES[type_name] * 2, np.uint8), 40)


class LegacyMatmulTests:
    @given(problem=strategies.legacy_matmul_problems())
    @SETTINGS
    def test_reference_matches_float64(self, problem):
        """The reference equals float64 numpy (the blocks' exact values times the q8_0-rounded
        activations) within LEGACY_SUM_TOLERANCE."""
        type_name, rows, cols, n_tokens, _, _, kind, seed = problem
        weights, x = make_problem(type_name, rows, cols, n_tokens, kind, seed)
        scale, minimum, quants = decode(type_name, weights, rows, cols)
        scaled = quants * np.repeat(scale, 32, axis=1)
        shift = np.repeat(minimum, 32, axis=1)
        activations = q8_activations(x)
        expected = activations @ (scaled + shift).T
        magnitudes = np.abs(activations) @ (np.abs(scaled) + np.abs(shift)).T
        got = kernels.matmul(type_name, weights, rows, cols, x, impl="reference")
        assert np.all(np.abs(got - expected) <= legacy_sum_tolerance(magnitudes, cols // 32))

    @given(problem=strategies.legacy_matmul_problems())
    @SETTINGS
    def test_avx2_equals_reference_bit_for_bit(self, problem):
        """The AVX2 file-layout tiles (VNNI in an avx512 library) give the reference's bits, on the
        rows asked for only."""
        impl = avx2_or_skip()
        type_name, rows, cols, n_tokens, row_begin, row_end, kind, seed = problem
        weights, x = make_problem(type_name, rows, cols, n_tokens, kind, seed)
        want = kernels.matmul(type_name, weights, rows, cols, x, impl="reference")
        got = kernels.matmul(type_name, weights, rows, cols, x, impl=impl, row_begin=row_begin, row_end=row_end)
        assert same_bits(got[:, row_begin:row_end], want[:, row_begin:row_end])
        assert np.isnan(got[:, :row_begin]).all() and np.isnan(got[:, row_end:]).all()

    @given(problem=strategies.legacy_matmul_problems(), split=st.integers(1, 8))
    @SETTINGS
    def test_results_do_not_depend_on_token_count(self, problem, split):
        """A token's outputs are the same bits computed with the other tokens or alone, in the
        engine's (dispatch) kernels."""
        type_name, rows, cols, n_tokens, row_begin, row_end, kind, seed = problem
        weights, x = make_problem(type_name, rows, cols, n_tokens, kind, seed)
        whole = kernels.matmul(type_name, weights, rows, cols, x)
        split = min(split, n_tokens)
        parts = np.concatenate([kernels.matmul(type_name, weights, rows, cols, x[:split]),
                                kernels.matmul(type_name, weights, rows, cols, x[split:])]) if split < n_tokens else whole
        assert same_bits(parts, whole)

    @pytest.mark.parametrize("type_name", LEGACY_TYPES)
    @pytest.mark.parametrize("rows, cols, n_tokens", [(37, 4864, 53), (61, 576, 9), (29, 1536, 1)])
    def test_large_shapes_agree(self, type_name, rows, cols, n_tokens):
        """Model-sized rows (several L2 blocks of activations) give the reference's bits, file
        layout and packed."""
        impl = avx2_or_skip()
        weights, x = make_problem(type_name, rows, cols, n_tokens, "quantized", 5)
        want = kernels.matmul(type_name, weights, rows, cols, x, impl="reference")
        assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl=impl), want)
        packed = kernels.pack(type_name, weights, rows, cols)
        assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl=impl), want)


# ---------------------------------------------------------------------------------------------
# Packed layout


def numpy_packed(type_name, data, rows, cols):
    """legacy.h's packed layout, built with numpy: whole groups of 8 rows where they are in the file,
    the rows past the last group as they are; in a group, block by block, the 8 scales, the 8
    minimums, the fifth bits (int32 lane r = row r, byte k of it holding in bit p the fifth bit of
    element 4p + k), then 4 chunks of nibbles, chunk i holding bytes 4i..4i+3 of each row."""
    size = BLOCK_BYTES[type_name]
    n_blocks = cols // 32
    blocks = np.asarray(data, np.uint8).reshape(rows, n_blocks, size)
    grouped = rows - rows % PACK_ROWS
    out = []
    for first in range(0, grouped, PACK_ROWS):
        group = blocks[first:first + PACK_ROWS]  # (8, n_blocks, size)
        for b in range(n_blocks):
            block = group[:, b, :]
            out.append(block[:, 0:2].reshape(-1))
            if HAS_MIN[type_name]:
                out.append(block[:, 2:4].reshape(-1))
            if HAS_FIFTH[type_name]:
                fifth = block[:, size - 20:size - 16].copy().view("<u4")[:, 0].astype(np.int64)  # (8,)
                element = 4 * np.arange(8)[None, :] + np.arange(4)[:, None]  # (byte k, bit p) -> 4p + k
                bits = (fifth[:, None, None] >> element[None]) & 1  # (row, k, p)
                out.append((bits << np.arange(8)).sum(axis=2).astype(np.uint8).reshape(-1))
            nibbles = block[:, size - 16:].reshape(PACK_ROWS, 4, 4)  # (row, chunk, byte)
            out.append(nibbles.transpose(1, 0, 2).reshape(-1))
    out.append(blocks[grouped:].reshape(-1))
    return np.concatenate(out)


class LegacyPackedTests:
    @given(problem=strategies.legacy_matmul_problems(max_rows=27))
    @SETTINGS
    def test_layout_matches_the_documented_one(self, problem):
        """kr_pack_rows writes exactly the layout legacy.h describes, at the file layout's size."""
        type_name, rows, cols, n_tokens, _, _, kind, seed = problem
        weights, _ = make_problem(type_name, rows, cols, n_tokens, kind, seed)
        got = kernels.pack(type_name, weights, rows, cols)
        assert got.size == weights.size
        assert np.array_equal(got, numpy_packed(type_name, weights, rows, cols))

    @pytest.mark.parametrize("impl", ["reference", "avx2", "dispatch"])
    @given(problem=strategies.legacy_matmul_problems(max_rows=27))
    @SETTINGS
    def test_packed_matmul_equals_file_layout_bit_for_bit(self, impl, problem):
        """Every implementation on packed weights gives the reference's bits on the file layout, for
        any row range (inside a group, across groups, the rows past the last group) and one or
        several tokens (the one-token tiles differ)."""
        if impl == "avx2":
            avx2_or_skip()
        type_name, rows, cols, n_tokens, row_begin, row_end, kind, seed = problem
        weights, x = make_problem(type_name, rows, cols, n_tokens, kind, seed)
        packed = kernels.pack(type_name, weights, rows, cols)
        want = kernels.matmul(type_name, weights, rows, cols, x, impl="reference")
        for tokens in (x, x[:1]):
            got = kernels.matmul_packed(type_name, packed, rows, cols, tokens, impl=impl, row_begin=row_begin,
                                        row_end=row_end)
            assert same_bits(got[:, row_begin:row_end], want[:len(tokens), row_begin:row_end])
            assert np.isnan(got[:, :row_begin]).all() and np.isnan(got[:, row_end:]).all()


# ---------------------------------------------------------------------------------------------
# Tiny models


def logits(path, tokens, *, batch, threads=1, pack_weights=True):
    with Model(path, threads=threads, pack=pack_weights) as model:
        with model.session(ctx=64, batch=batch) as session:
            return session.eval(tokens)


TOKENS = [3, 17, 5, 60, 2, 9, 41, 33, 12, 7, 50, 1, 28, 44, 6, 19, 30]


class LegacyTinyModelTests:
    @pytest.mark.parametrize("weight_type", LEGACY_TYPES)
    @pytest.mark.parametrize("arch", ARCHS)
    def test_engine_matches_the_numpy_reference(self, tmp_path, arch, weight_type):
        """Every matrix (and the head) in the type: the last token's logits agree with the numpy
        reference that rounds activations to q8_0 as the engine does (cosine >= 0.999 after
        removing the mean, and the same top token up to the engine's own error)."""
        from tests.test_engine import assert_logits_match

        path = tmp_path / "model.mlb"
        write_tiny_model(path, arch, seed=3, weight_type=weight_type)
        reference = ReferenceModel(path, q8_activations=True).forward(TOKENS)
        assert_logits_match(logits(path, TOKENS, batch=5), reference[-1], True)

    @pytest.mark.parametrize("weight_type", LEGACY_TYPES)
    @pytest.mark.parametrize("arch", ARCHS)
    def test_packed_batches_and_threads_give_the_same_bits(self, tmp_path, arch, weight_type):
        """Packed or not, batch 1, 5 or the whole prompt, 1 or 2 threads: the same logits, bit for bit."""
        path = tmp_path / "model.mlb"
        write_tiny_model(path, arch, seed=5, weight_type=weight_type)
        expected = logits(path, TOKENS, batch=len(TOKENS), pack_weights=False)
        for batch in (1, 5, len(TOKENS)):
            for threads in (1, 2):
                assert same_bits(logits(path, TOKENS, batch=batch, threads=threads), expected), (batch, threads)
        with Model(path, pack=True) as model:
            assert pack.status(model)[0] == 1  # the matrices really were packed


class EmptyRowsTests:
    @pytest.mark.parametrize("type_name", ("q8_0", "q4_0") + LEGACY_TYPES + kernels.KQUANTS)
    @pytest.mark.parametrize("impl", ["reference", "avx2", "dispatch"])
    def test_zero_columns_give_zeros(self, type_name, impl):
        """A matrix of 0 columns (no blocks) multiplies to zeros, file layout and packed, with whole
        groups of 8 rows and a rest: no division by the empty rows' size (the k-quant tiles too)."""
        if impl == "avx2":
            avx2_or_skip()
        empty, x = np.zeros(0, np.uint8), np.zeros((3, 0), np.float32)
        assert same_bits(kernels.matmul(type_name, empty, 9, 0, x, impl=impl), np.zeros((3, 9)))
        packed = kernels.pack(type_name, empty, 9, 0)
        assert same_bits(kernels.matmul_packed(type_name, packed, 9, 0, x, impl=impl), np.zeros((3, 9)))


# ---------------------------------------------------------------------------------------------
# Real weights: the published files' q4_1 (SmolLM2) and q5_0 (Qwen2.5-Coder, Gemma 3) matrices

REAL_MATRICES = [("smollm2-135m", "blk.0.ffn_gate.weight", "q4_1"), ("smollm2-135m", "blk.29.attn_k.weight", "q4_1"),
                 ("qwen2.5-coder-0.5b", "blk.3.ffn_up.weight", "q5_0"), ("gemma3-270m", "blk.0.attn_q.weight", "q5_0")]


def real_matrix(name, tensor_name, rows):
    """The first `rows` rows of a GGUF tensor: (raw bytes, its type's name, rows, cols)."""
    from tests.support.real_models import gguf_reader

    tensor = next(t for t in gguf_reader(name).tensors if t.name == tensor_name)
    cols = int(tensor.shape[0])
    data = np.asarray(tensor.data).reshape(-1, kernels.row_bytes(tensor.tensor_type.name.lower(), cols))[:rows]
    return np.ascontiguousarray(data).reshape(-1), tensor.tensor_type.name.lower(), rows, cols


class LegacyRealWeightTests:
    @pytest.mark.parametrize("name, tensor_name, type_name", REAL_MATRICES)
    def test_real_matrices_agree_everywhere(self, testdata, name, tensor_name, type_name):
        """A published file's matrix (its first 100 rows: 12 whole groups and a rest) against
        activations of a real model's spread: every implementation, file layout and packed, one
        token and 19, gives the reference's bits; the reference is within LEGACY_SUM_TOLERANCE of
        float64 numpy; dequantization equals gguf-py's."""
        weights, found_type, rows, cols = real_matrix(name, tensor_name, 100)
        assert found_type == type_name
        x = random_float32(np.random.default_rng(3), (19, cols))
        want = kernels.matmul(type_name, weights, rows, cols, x, impl="reference")
        packed = kernels.pack(type_name, weights, rows, cols)
        impls = ["dispatch"] + (["avx2"] if kernels.has_avx2() else [])
        for impl in impls:
            for tokens in (x[:1], x):
                assert same_bits(kernels.matmul(type_name, weights, rows, cols, tokens, impl=impl), want[:len(tokens)])
                assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, tokens, impl=impl), want[:len(tokens)])
        scale, minimum, quants = decode(type_name, weights, rows, cols)
        exact = quants * np.repeat(scale, 32, axis=1) + np.repeat(minimum, 32, axis=1)
        activations = q8_activations(x)
        magnitudes = np.abs(activations) @ (np.abs(quants * np.repeat(scale, 32, axis=1)) + np.abs(np.repeat(minimum, 32, axis=1))).T
        assert np.all(np.abs(want - activations @ exact.T) <= legacy_sum_tolerance(magnitudes, cols // 32))
        expected_rows = gguf_dequantize(weights.reshape(rows, -1), GGUF_TYPES[type_name])
        assert same_bits(kernels.dequantize(type_name, weights[:kernels.row_bytes(type_name, cols)], cols), expected_rows[0])
