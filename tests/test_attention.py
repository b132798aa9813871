"""Attention over blocks of queries (engine_c/src/kernels/attention.c; docs/kernels.md, "Attention").

Pinned here:
- kr_attend_scores, the scores of float keys for several queries: AVX2 equals the reference bit
  for bit, and both equal kr_matmul (what attention used before, and still uses for q8_0 keys) for
  every position a query needs; the float64 dot within FLOAT32_SUM_TOLERANCE.
- kr_attend_values, the weighted sum of value rows for several queries at once: the AVX2 version
  equals the reference bit for bit (f32, f16 and q8_0 rows, any sizes and ranges); one query is
  exactly kr_axpy_rows from zero over its range (the order the engine defines); a query's bits do
  not depend on which other queries share the call; a non-finite value outside a query's range
  never reaches it; and the reference is the float64 numpy sum within FLOAT32_SUM_TOLERANCE.
- kr_attention_softmax: AVX2 equals the reference bit for bit, with and without softcap, and both
  are numpy's float64 softmax within SOFTMAX_TOLERANCE (softmax_tolerance).
- Bad arguments are refused with a message.
The engine's use of them (bitwise reproducibility over batch, threads and splits; logits against
the numpy reference) is pinned in test_reproducibility.py, test_reference_tiny.py, test_kv_q8.py.
"""

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize
from hypothesis import given, settings, strategies as st

from krafla_twisted.engine import clib, formats, kernels
from tests.test_kernels import avx2_or_skip, float32_sum_tolerance, same_bits

TYPES = {name: formats.TENSOR_TYPES_BY_NAME[name].code for name in ("f32", "f16", "q8_0")}


def softmax_tolerance(n, softcap):
    """SOFTMAX_TOLERANCE, absolute on weights <= 1: krafla's exp is within 2 ulp
    (test_kernels.EXP_ULP_TOLERANCE), x - max, 1/sum and the products round once each, the float32
    sum of n terms is within n ulp of the total: (n + 8) * 2^-24 relative per weight. A softcap
    adds the float32 division, tanhf and product on logits up to |softcap|: 4 ulp of it,
    absolute on the logit, which is relative on the weight."""
    return (n + 8 + 4 * softcap) * 2.0**-24


_p = ctypes.c_void_p
_i64 = ctypes.c_int64


@clib.prototypes
def _declare(lib):
    # int kr_test_attend_values(int impl, int32_t type, const void *values, int64_t row_stride, int64_t n_rows,
    #                           int64_t n, const float *weights, int64_t n_queries, const int32_t *begin,
    #                           const int32_t *end, float *out, kr_error *err);
    clib.declare(lib, "kr_test_attend_values", ctypes.c_int, ctypes.c_int, ctypes.c_int32, _p, _i64, _i64, _i64, _p,
                 _i64, _p, _p, _p, ctypes.POINTER(clib.kr_error))
    # int kr_test_attend_scores(int impl, int32_t type, const void *keys, int64_t row_stride, int64_t n_rows,
    #                           int64_t n, const float *queries, int64_t n_queries, const int32_t *end, float *out,
    #                           kr_error *err);
    clib.declare(lib, "kr_test_attend_scores", ctypes.c_int, ctypes.c_int, ctypes.c_int32, _p, _i64, _i64, _i64, _p,
                 _i64, _p, _p, ctypes.POINTER(clib.kr_error))
    # int kr_test_attention_softmax(int impl, float *x, int64_t n, float scale, float softcap, kr_error *err);
    clib.declare(lib, "kr_test_attention_softmax", ctypes.c_int, ctypes.c_int, _p, _i64, ctypes.c_float,
                 ctypes.c_float, ctypes.POINTER(clib.kr_error))


def _call(function, *args):
    error = clib.kr_error()
    error.check(function(*args, ctypes.byref(error)))


def attend_values(type_name, rows, n, weights, begin, end, impl="dispatch"):
    """out (n_queries, n): query i folds rows [begin[i], end[i]) of `rows` (f32/f16 (n_rows, >= n),
    or q8_0 blocks uint8 (n_rows, n/32*34)) with its weights row."""
    rows = np.ascontiguousarray(rows)
    weights = np.ascontiguousarray(weights, np.float32)
    begin = np.ascontiguousarray(begin, np.int32)
    end = np.ascontiguousarray(end, np.int32)
    out = np.full((len(begin), n), np.nan, np.float32)
    _call(clib.load().kr_test_attend_values, kernels.IMPLEMENTATIONS[impl], TYPES[type_name], rows.ctypes.data, rows.strides[0],
          rows.shape[0], n, weights.ctypes.data, len(begin), begin.ctypes.data, end.ctypes.data, out.ctypes.data)
    return out


def attend_scores(type_name, keys, queries, end, impl="dispatch"):
    """out (n_queries, n_rows): out[i, p] = dot(keys[p], queries[i]) for p < end[i]; the rest of each
    row is NaN or a score the kernel computed on the way (for a neighbour's range)."""
    keys = np.ascontiguousarray(keys)
    queries = np.ascontiguousarray(queries, np.float32)
    end = np.ascontiguousarray(end, np.int32)
    out = np.full((queries.shape[0], keys.shape[0]), np.nan, np.float32)
    _call(clib.load().kr_test_attend_scores, kernels.IMPLEMENTATIONS[impl], TYPES[type_name], keys.ctypes.data, keys.strides[0],
          keys.shape[0], queries.shape[1], queries.ctypes.data, queries.shape[0], end.ctypes.data, out.ctypes.data)
    return out


def attention_softmax(x, scale, softcap=0.0, impl="dispatch"):
    x = np.array(x, np.float32, copy=True)
    _call(clib.load().kr_test_attention_softmax, kernels.IMPLEMENTATIONS[impl], x.ctypes.data, x.size, ctypes.c_float(scale),
          ctypes.c_float(softcap))
    return x


def value_rows(rng, type_name, n_rows, n):
    """(stored rows, their float64 values): values spread over orders of magnitude per row."""
    values = (rng.standard_normal((n_rows, n)) * np.exp(rng.uniform(-4, 4, (n_rows, 1)))).astype(np.float32)
    if type_name == "q8_0":
        blocks = gguf_quantize(values, GGMLQuantizationType.Q8_0).reshape(n_rows, n // 32 * 34)
        return blocks, gguf_dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float64).reshape(n_rows, n)
    stored = values.astype(np.float16 if type_name == "f16" else np.float32)
    return stored, stored.astype(np.float64)


@st.composite
def attention_blocks(draw):
    """A type, a row width, rows, and queries with their own ranges (some empty, some shared). The
    fast kernel's paths are all drawn here: in AVX-512 builds rows of up to 256 values for up to 64
    queries go whole, in chunks of about 16 KiB (so more rows than a chunk holds: up to 80 rows of up
    to 1 KiB); otherwise rows of 512 bytes and more with at most 4 queries go in order, up to 64
    queries in spans of 64 values over the same chunks, and more queries in column strips."""
    type_name = draw(st.sampled_from(sorted(TYPES)))
    if type_name == "q8_0":
        n = 32 * draw(st.sampled_from([1, 2, 3, 4, 7, 16, 17]))
    else:
        n = draw(st.one_of(st.integers(1, 80), st.sampled_from([128, 256, 263])))
    n_rows = draw(st.integers(0, 80))
    n_queries = draw(st.one_of(st.integers(1, 11), st.integers(60, 70)))
    ranges = [sorted(draw(st.lists(st.integers(0, n_rows), min_size=2, max_size=2))) for _ in range(n_queries)]
    return type_name, n, n_rows, [r[0] for r in ranges], [r[1] for r in ranges], draw(st.integers(0, 2**32 - 1))


def implementations():
    return ("reference", "dispatch") + (("avx2",) if kernels.has_avx2() else ())


class AttendValuesTests:
    @settings(max_examples=150, deadline=None)
    @given(block=attention_blocks())
    def test_avx2_equals_reference_bit_for_bit(self, block):
        """Any type, width, number of queries and ranges: the AVX2 kernel gives the reference's bits."""
        fast = avx2_or_skip()
        type_name, n, n_rows, begin, end, seed = block
        rng = np.random.default_rng(seed)
        rows, _ = value_rows(rng, type_name, n_rows, n)
        weights = rng.random((len(begin), n_rows)).astype(np.float32)
        assert same_bits(attend_values(type_name, rows, n, weights, begin, end, fast),
                         attend_values(type_name, rows, n, weights, begin, end, "reference"))

    @settings(max_examples=60, deadline=None)
    @given(block=attention_blocks())
    def test_a_query_is_kr_axpy_rows_from_zero_whatever_its_neighbours(self, block):
        """Each query, computed among the others, alone, or in reverse order, is kr_axpy_rows over its
        own rows starting from zeros, bit for bit: the fold order the engine defines."""
        type_name, n, n_rows, begin, end, seed = block
        rng = np.random.default_rng(seed)
        rows, _ = value_rows(rng, type_name, n_rows, n)
        weights = rng.random((len(begin), n_rows)).astype(np.float32)
        for impl in implementations():
            together = attend_values(type_name, rows, n, weights, begin, end, impl)
            backwards = attend_values(type_name, rows, n, weights[::-1], begin[::-1], end[::-1], impl)[::-1]
            assert same_bits(together, backwards), impl
            for i, (first, last) in enumerate(zip(begin, end)):
                alone = attend_values(type_name, rows, n, weights[i:i + 1], [first], [last], impl)[0]
                if type_name == "q8_0":
                    expected = kernels.axpy_rows_q8_0(weights[i, first:last], rows[first:last], np.zeros(n), impl)
                else:
                    expected = kernels.axpy_rows(weights[i, first:last], rows[first:last], np.zeros(n), impl)
                assert same_bits(together[i], alone), (impl, i)
                assert same_bits(alone, expected), (impl, i)

    @settings(max_examples=60, deadline=None)
    @given(block=attention_blocks())
    def test_reference_is_the_float64_weighted_sum(self, block):
        """sum over the query's rows of w_p * V_p, in float64 numpy (q8_0 rows dequantized by
        gguf-py), within FLOAT32_SUM_TOLERANCE (test_kernels.float32_sum_tolerance)."""
        type_name, n, n_rows, begin, end, seed = block
        rng = np.random.default_rng(seed)
        rows, exact = value_rows(rng, type_name, n_rows, n)
        weights = rng.random((len(begin), n_rows)).astype(np.float32)
        got = attend_values(type_name, rows, n, weights, begin, end, "reference")
        for i, (first, last) in enumerate(zip(begin, end)):
            w = weights[i, first:last].astype(np.float64)
            want = w @ exact[first:last] if last > first else np.zeros(n)
            magnitude = np.abs(w) @ np.abs(exact[first:last]) if last > first else np.zeros(n)
            assert (np.abs(got[i] - want) <= float32_sum_tolerance(magnitude, last - first + 1)).all(), i

    @pytest.mark.parametrize("type_name", ["f32", "f16"])
    def test_values_outside_a_range_never_reach_it(self, type_name):
        """inf and NaN in rows a query does not see (a later token's, before a sliding window) leave
        it finite, though queries that do see them share its group: nothing is multiplied by a 0
        weight."""
        rng = np.random.default_rng(3)
        rows, _ = value_rows(rng, type_name, 12, 40)
        rows[0, 5] = np.inf
        rows[11, 7] = np.nan
        weights = rng.random((4, 12)).astype(np.float32)
        begin, end = [1, 0, 1, 1], [11, 12, 10, 11]
        for impl in implementations():
            out = attend_values(type_name, rows, 40, weights, begin, end, impl)
            assert np.isfinite(out[[0, 2, 3]]).all(), impl
            assert np.isnan(out[1, 7]) and np.isinf(out[1, 5]), impl

    def test_bad_arguments_are_refused(self):
        """Ranges outside the rows, reversed ranges, q8_0 widths that are not whole blocks, other types."""
        rows = np.zeros((4, 32), np.float32)
        weights = np.ones((1, 4), np.float32)
        with pytest.raises(clib.KraflaError, match="not inside"):
            attend_values("f32", rows, 32, weights, [0], [5])
        with pytest.raises(clib.KraflaError, match="not inside"):
            attend_values("f32", rows, 32, weights, [3], [2])
        with pytest.raises(clib.KraflaError, match="whole blocks"):
            attend_values("q8_0", np.zeros((4, 34), np.uint8), 16, weights, [0], [4])
        with pytest.raises(clib.KraflaError, match="type 4"):
            _call(clib.load().kr_test_attend_values, 0, 4, rows.ctypes.data, 128, 4, 32, weights.ctypes.data, 1,
                  np.zeros(1, np.int32).ctypes.data, np.ones(1, np.int32).ctypes.data, rows.ctypes.data)


@st.composite
def score_blocks(draw):
    """Float keys, a width (8-lane steps and a tail), queries with their own ends."""
    type_name = draw(st.sampled_from(["f32", "f16"]))
    n, n_rows, n_queries = draw(st.integers(1, 80)), draw(st.integers(0, 30)), draw(st.integers(1, 9))
    end = draw(st.lists(st.integers(0, n_rows), min_size=n_queries, max_size=n_queries))
    return type_name, n, n_rows, end, draw(st.integers(0, 2**32 - 1))


def score_inputs(type_name, n, n_rows, n_queries, seed):
    rng = np.random.default_rng(seed)
    keys, exact = value_rows(rng, type_name, n_rows, n)
    queries = (rng.standard_normal((n_queries, n)) * np.exp(rng.uniform(-3, 3, (n_queries, 1)))).astype(np.float32)
    return keys, exact, queries


def needed(out, end):
    """The scores each query needs, one array per query."""
    return [row[:e] for row, e in zip(out, end)]


class AttendScoresTests:
    @settings(max_examples=150, deadline=None)
    @given(block=score_blocks())
    def test_avx2_equals_reference_and_kr_matmul_bit_for_bit(self, block):
        """Every score a query needs is kr_matmul's bits (kernels.matmul, the keys as weight rows),
        in the reference and the AVX2 kernel."""
        type_name, n, n_rows, end, seed = block
        keys, _, queries = score_inputs(type_name, n, n_rows, len(end), seed)
        matmul = (kernels.matmul(type_name, keys.tobytes(), n_rows, n, queries, "reference")
                  if n_rows else np.zeros((len(end), 0), np.float32))
        for impl in implementations():
            got = attend_scores(type_name, keys, queries, end, impl)
            for i, (row, want) in enumerate(zip(needed(got, end), needed(matmul, end))):
                assert same_bits(row, want), (impl, i)

    @settings(max_examples=60, deadline=None)
    @given(block=score_blocks())
    def test_reference_is_the_float64_dot(self, block):
        """dot(key p, query i) in float64 numpy within FLOAT32_SUM_TOLERANCE."""
        type_name, n, n_rows, end, seed = block
        keys, exact, queries = score_inputs(type_name, n, n_rows, len(end), seed)
        got = attend_scores(type_name, keys, queries, end, "reference")
        want = queries.astype(np.float64) @ exact.T
        magnitude = np.abs(queries.astype(np.float64)) @ np.abs(exact.T)
        for i, e in enumerate(end):
            assert (np.abs(got[i, :e] - want[i, :e]) <= float32_sum_tolerance(magnitude[i, :e], n)).all(), i

    def test_bad_arguments_are_refused(self):
        """Ends past the keys, q8_0 (or other) key types."""
        keys = np.zeros((4, 8), np.float32)
        with pytest.raises(clib.KraflaError, match="not inside"):
            attend_scores("f32", keys, np.zeros((1, 8)), [5])
        with pytest.raises(clib.KraflaError, match="type 3"):
            attend_scores("q8_0", np.zeros((4, 34), np.uint8), np.zeros((1, 32)), [4])


class AttentionSoftmaxTests:
    @settings(max_examples=100, deadline=None)
    @given(n=st.integers(1, 300), softcap=st.sampled_from([0.0, 50.0, 5.0]), seed=st.integers(0, 2**32 - 1))
    def test_avx2_equals_reference_bit_for_bit(self, n, softcap, seed):
        """Scores of any length and spread, with and without softcap: the same bits."""
        fast = avx2_or_skip()
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 5))).astype(np.float32)
        x[rng.random(n) < 0.1] = 0.0
        scale = np.float32(rng.uniform(0.01, 1))
        assert same_bits(attention_softmax(x, scale, softcap, fast), attention_softmax(x, scale, softcap, "reference"))

    @settings(max_examples=60, deadline=None)
    @given(n=st.integers(1, 300), softcap=st.sampled_from([0.0, 50.0, 5.0]), seed=st.integers(0, 2**32 - 1))
    def test_is_the_float64_softmax(self, n, softcap, seed):
        """Each implementation is numpy's float64 softmax of the scaled (soft-capped) scores within
        SOFTMAX_TOLERANCE."""
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-3, 5))).astype(np.float32)
        scale = np.float32(rng.uniform(0.01, 1))
        logits = (x * scale).astype(np.float32).astype(np.float64)  # the one float32 product on both sides
        if softcap:
            logits = softcap * np.tanh(logits / softcap)
        want = np.exp(logits - logits.max())
        want /= want.sum()
        for impl in implementations():
            got = attention_softmax(x, scale, softcap, impl)
            assert np.abs(got - want).max() <= softmax_tolerance(n, softcap), impl

    def test_nan_scores_make_every_weight_nan_in_both(self):
        """A NaN score is not taken as the maximum by either implementation, and poisons the sum:
        all weights NaN in both, as in the reference."""
        x = np.array([1.0, np.nan] + [0.5] * 10, np.float32)
        for impl in implementations():
            assert np.isnan(attention_softmax(x, 1.0, 0.0, impl)).all(), impl

    def test_bad_arguments_are_refused(self):
        """No values, a non-finite scale or a negative softcap."""
        with pytest.raises(clib.KraflaError, match="at least one"):
            attention_softmax(np.zeros(0, np.float32), 1.0)
        with pytest.raises(clib.KraflaError, match="finite"):
            attention_softmax(np.zeros(4, np.float32), np.inf)
        with pytest.raises(clib.KraflaError, match="finite"):
            attention_softmax(np.zeros(4, np.float32), 1.0, -1.0)
