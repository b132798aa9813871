"""ctypes bindings for the numeric kernels' test entry points (krafla.h, "Kernels (tests)").

Each function runs one kernel of engine_c/src/kernels/kernels.h on numpy arrays, under a chosen
implementation: "dispatch" (what the engine calls), "reference" (quant_ref.c) or "avx2"
(kernels_avx2.c; a library built with ISA=generic raises KraflaError for it). Tests and
bench/kernels.py use these; the engine itself calls the kernels from C.
"""

import ctypes

import numpy as np

from krafla_twisted.engine import clib, formats, header

IMPLEMENTATIONS = {name.lower(): code for name, code in header.members("KR_KERNEL_").items()}
# The weight types the test entry points take (krafla.h, "Kernels (tests)").
WEIGHT_TYPES = {name: formats.TENSOR_TYPES_BY_NAME[name].code
                for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K",
                             "q2_K", "q3_K", "iq4_nl", "iq4_xs", "mxfp4")}
BLOCK = formats.Q8_0.block
BLOCK_BYTES = {name: formats.TENSOR_TYPES_BY_NAME[name].block_bytes for name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")}
# k-quants: super-blocks of 256 weights (kernels.h, "k-quants")
SUPER_BLOCK = formats.Q4_K.block
SUPER_BLOCK_BYTES = {name: formats.TENSOR_TYPES_BY_NAME[name].block_bytes for name in ("q4_K", "q5_K", "q6_K")}
KQUANTS = tuple(SUPER_BLOCK_BYTES)
# The types with a packed layout (`pack`; types.c's packable column).
PACKABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K", "iq4_nl", "mxfp4")
# A q8_K activation block, as kernels.h's kr_block_q8_K lays it out (292 bytes).
Q8_K_BLOCK = np.dtype([("d", "<f4"), ("q", "i1", (256,)), ("bsums", "<i2", (16,))])

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_int = ctypes.c_int
_err = ctypes.POINTER(clib.kr_error)


@clib.prototypes
def _declare(lib):
    # int kr_test_f16_to_f32(int impl, const uint16_t *x, float *y, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_f16_to_f32", _int, _int, _p, _p, _i64, _err)
    # int kr_test_f32_to_f16(int impl, const float *x, uint16_t *y, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_f32_to_f16", _int, _int, _p, _p, _i64, _err)
    # int kr_test_quantize_q8_0(int impl, const float *x, void *blocks, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_quantize_q8_0", _int, _int, _p, _p, _i64, _err)
    # int kr_test_quantize_q8_K(int impl, const float *x, void *blocks, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_quantize_q8_K", _int, _int, _p, _p, _i64, _err)
    # int kr_test_dequantize(int32_t type, const void *row, float *out, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_dequantize", _int, _i32, _p, _p, _i64, _err)
    # int kr_test_matmul(int impl, int32_t weight_type, const void *weights, int64_t rows, int64_t cols,
    #                    const float *x, int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end,
    #                    kr_error *err);
    clib.declare(lib, "kr_test_matmul", _int, _int, _i32, _p, _i64, _i64, _p, _i64, _p, _i64, _i64, _err)
    # int kr_test_dot(int impl, int32_t type, const void *a, const float *b, int64_t n, float *result,
    #                 kr_error *err);
    clib.declare(lib, "kr_test_dot", _int, _int, _i32, _p, _p, _i64, _p, _err)
    # int kr_test_axpy(int impl, int32_t type, float alpha, const void *x, float *y, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_axpy", _int, _int, _i32, ctypes.c_float, _p, _p, _i64, _err)
    # int kr_test_dot_rows(int impl, int32_t type, const void *rows, int64_t row_stride, int64_t n_rows,
    #                      const float *x, int64_t n, float *out, kr_error *err);
    clib.declare(lib, "kr_test_dot_rows", _int, _int, _i32, _p, _i64, _i64, _p, _i64, _p, _err)
    # int kr_test_axpy_rows(int impl, int32_t type, const float *weights, const void *rows, int64_t row_stride,
    #                       int64_t n_rows, float *y, int64_t n, kr_error *err);
    clib.declare(lib, "kr_test_axpy_rows", _int, _int, _i32, _p, _p, _i64, _i64, _p, _i64, _err)
    # int kr_test_elementwise(int impl, int32_t which, float *x, float *y, int64_t n, float shift, float *sum,
    #                         kr_error *err);
    clib.declare(lib, "kr_test_elementwise", _int, _int, _i32, _p, _p, _i64, ctypes.c_float, _p, _err)
    # int kr_test_delta_rule(int impl, float *state, int64_t dk, int64_t dv, const float *q, const float *k,
    #                        const float *v, float beta, float decay, float *out, kr_error *err);
    clib.declare(lib, "kr_test_delta_rule", _int, _int, _p, _i64, _i64, _p, _p, _p, ctypes.c_float, ctypes.c_float,
                 _p, _err)
    # int kr_bench_matmul(int impl, int32_t weight_type, const void *weights, int32_t packed, int64_t rows,
    #                     int64_t cols, const float *x, int64_t n_tokens, int32_t repeat, double *best_seconds,
    #                     kr_error *err);
    clib.declare(lib, "kr_bench_matmul", _int, _int, _i32, _p, _i32, _i64, _i64, _p, _i64, _i32, _p, _err)
    # int kr_test_pack(int32_t weight_type, const void *weights, int64_t rows, int64_t cols, void *packed,
    #                  kr_error *err);
    clib.declare(lib, "kr_test_pack", _int, _i32, _p, _i64, _i64, _p, _err)
    # int kr_test_matmul_packed(int impl, int32_t weight_type, const void *packed, int64_t rows, int64_t cols,
    #                           const float *x, int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end,
    #                           kr_error *err);
    clib.declare(lib, "kr_test_matmul_packed", _int, _int, _i32, _p, _i64, _i64, _p, _i64, _p, _i64, _i64, _err)
    # int kr_test_dequantize_packed(int32_t weight_type, const void *packed, int64_t rows, int64_t cols, int64_t row,
    #                               float *out, kr_error *err);
    clib.declare(lib, "kr_test_dequantize_packed", _int, _i32, _p, _i64, _i64, _i64, _p, _err)


isa = clib.loaded_isa


def has_avx2():
    """True if the loaded library has the AVX2 kernels (ISA=avx2 and avx512 builds do)."""
    return isa() in ("avx2", "avx512")


def _impl(name):
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown kernel implementation {name!r}; expected one of {sorted(IMPLEMENTATIONS)}") from None


def _weight_type(name):
    try:
        return WEIGHT_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown weight type {name!r}; expected one of {sorted(WEIGHT_TYPES)}") from None


def _array(data, dtype):
    """A C-contiguous array of dtype; bytes-like data is viewed, not copied."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=dtype)
    return np.ascontiguousarray(data, dtype=dtype)


def _call(function, *args):
    error = clib.kr_error()
    status = function(*args, ctypes.byref(error))
    error.check(status)


def _ptr(array):
    return array.ctypes.data_as(ctypes.c_void_p)


def row_bytes(type_name, cols):
    """Bytes of one row of `cols` weights of type_name in the file layout."""
    _weight_type(type_name)
    tensor_type = formats.TENSOR_TYPES_BY_NAME[type_name]
    if cols % tensor_type.block:
        raise ValueError(f"{type_name} rows need a multiple of {tensor_type.block} columns, got {cols}")
    return tensor_type.nbytes((cols,))


def f16_to_f32(bits, impl="dispatch"):
    """uint16 half-precision bit patterns -> float32 values."""
    x = _array(bits, np.uint16)
    y = np.empty(x.shape, np.float32)
    _call(clib.load().kr_test_f16_to_f32, _impl(impl), _ptr(x), _ptr(y), x.size)
    return y


def f32_to_f16(values, impl="dispatch"):
    """float32 values -> uint16 half-precision bit patterns (round to nearest even)."""
    x = _array(values, np.float32)
    y = np.empty(x.shape, np.uint16)
    _call(clib.load().kr_test_f32_to_f16, _impl(impl), _ptr(x), _ptr(y), x.size)
    return y


def quantize_q8_0(values, impl="dispatch"):
    """float32 values (size a multiple of 32) -> q8_0 blocks as a uint8 array of size/32*34 bytes."""
    x = _array(values, np.float32).reshape(-1)
    if x.size % BLOCK:
        raise ValueError(f"q8_0 quantizes whole blocks of {BLOCK} values, got {x.size}")
    y = np.empty(x.size // BLOCK * BLOCK_BYTES["q8_0"], np.uint8)
    _call(clib.load().kr_test_quantize_q8_0, _impl(impl), _ptr(x), _ptr(y), x.size)
    return y


def quantize_q8_K(values, impl="dispatch"):
    """float32 values (size a multiple of 256) -> q8_K blocks: a structured array of Q8_K_BLOCK (d, q, bsums)."""
    x = _array(values, np.float32).reshape(-1)
    if x.size % SUPER_BLOCK:
        raise ValueError(f"q8_K quantizes whole blocks of {SUPER_BLOCK} values, got {x.size}")
    y = np.zeros(x.size // SUPER_BLOCK, Q8_K_BLOCK)
    _call(clib.load().kr_test_quantize_q8_K, _impl(impl), _ptr(x), _ptr(y), x.size)
    return y


def dequantize(type_name, row, n):
    """One row of n weights of type_name (raw bytes in the file layout) -> float32 (n,)."""
    data = _array(row, np.uint8)
    if data.size != row_bytes(type_name, n):
        raise ValueError(f"{n} {type_name} weights take {row_bytes(type_name, n)} bytes, got {data.size}")
    out = np.empty(n, np.float32)
    _call(clib.load().kr_test_dequantize, _weight_type(type_name), _ptr(data), _ptr(out), n)
    return out


def _weight_bytes(type_name, weights, rows, cols):
    w = _array(weights, np.uint8)
    if w.size != rows * row_bytes(type_name, cols):
        raise ValueError(f"{rows}x{cols} {type_name} weights take {rows * row_bytes(type_name, cols)} bytes, got {w.size}")
    return w


def _matmul(entry, type_name, weights, rows, cols, x, impl, row_begin, row_end):
    w = _weight_bytes(type_name, weights, rows, cols)
    x = _array(x, np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must be (n_tokens, {cols}), got {x.shape}")
    row_end = rows if row_end is None else row_end
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    _call(entry, _impl(impl), _weight_type(type_name), _ptr(w), rows, cols, _ptr(x), x.shape[0], _ptr(out),
          row_begin, row_end)
    return out


def matmul(type_name, weights, rows, cols, x, impl="dispatch", row_begin=0, row_end=None):
    """W (rows, cols) of type_name @ x (n_tokens, cols) -> float32 (n_tokens, rows).

    Only output rows [row_begin, row_end) are computed; the others are NaN. The activations are
    prepared (quantized to q8_0 for the blocks-of-32 weight types, q8_K for k-quants) by the same implementation."""
    return _matmul(clib.load().kr_test_matmul, type_name, weights, rows, cols, x, impl, row_begin, row_end)


def pack(type_name, weights, rows, cols):
    """A (rows, cols) matrix of a PACKABLE type (raw bytes, file layout) in the packed layout (uint8,
    same size)."""
    w = _weight_bytes(type_name, weights, rows, cols)
    out = np.empty_like(w)
    _call(clib.load().kr_test_pack, _weight_type(type_name), _ptr(w), rows, cols, _ptr(out))
    return out


def matmul_packed(type_name, packed, rows, cols, x, impl="dispatch", row_begin=0, row_end=None):
    """`matmul` on weights in the packed layout (from `pack`)."""
    return _matmul(clib.load().kr_test_matmul_packed, type_name, packed, rows, cols, x, impl, row_begin, row_end)


def dequantize_packed(type_name, packed, rows, cols, row):
    """Row `row` of a packed (rows, cols) matrix (from `pack`) -> float32 (cols,): what the model
    looks up when a tied output head is packed."""
    w = _weight_bytes(type_name, packed, rows, cols)
    out = np.empty(cols, np.float32)
    _call(clib.load().kr_test_dequantize_packed, _weight_type(type_name), _ptr(w), rows, cols, row, _ptr(out))
    return out


def dot(a, b, impl="dispatch"):
    """dot(a, b) for a float32 or float16 vector a and a float32 vector b of the same length."""
    type_name = "f16" if np.asarray(a).dtype == np.float16 else "f32"
    a = _array(a, np.float16 if type_name == "f16" else np.float32)
    b = _array(b, np.float32)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"dot needs two vectors of one length, got {a.shape} and {b.shape}")
    result = ctypes.c_float()
    _call(clib.load().kr_test_dot, _impl(impl), _weight_type(type_name), _ptr(a), _ptr(b), a.size, ctypes.byref(result))
    return np.float32(result.value)


def axpy(alpha, x, y, impl="dispatch"):
    """y + alpha * x (one fused multiply-add per element) for x float32 or float16, y float32; returns a new y."""
    type_name = "f16" if np.asarray(x).dtype == np.float16 else "f32"
    x = _array(x, np.float16 if type_name == "f16" else np.float32)
    out = np.array(y, dtype=np.float32, copy=True, order="C")
    if x.shape != out.shape or x.ndim != 1:
        raise ValueError(f"axpy needs two vectors of one length, got {x.shape} and {out.shape}")
    _call(clib.load().kr_test_axpy, _impl(impl), _weight_type(type_name), ctypes.c_float(alpha), _ptr(x), _ptr(out), x.size)
    return out


def _cache_rows(rows, n):
    """A (n_rows, stride) float32/float16 array whose first n columns are the rows (as a KV cache
    holds one head's slice of a wider row): the array, its type name and its row stride in bytes."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.dtype not in (np.float32, np.float16) or rows.shape[1] < n:
        raise ValueError(f"rows must be a 2-d float32 or float16 array at least {n} wide, got {rows.dtype} {rows.shape}")
    rows = np.ascontiguousarray(rows)
    return rows, "f16" if rows.dtype == np.float16 else "f32", rows.shape[1] * rows.itemsize


def dot_rows(rows, x, impl="dispatch"):
    """dot(rows[i, :n], x) for every row, n = len(x): float32 (n_rows,)."""
    x = _array(x, np.float32)
    rows, type_name, stride = _cache_rows(rows, x.size)
    out = np.empty(rows.shape[0], np.float32)
    _call(clib.load().kr_test_dot_rows, _impl(impl), _weight_type(type_name), _ptr(rows), stride, rows.shape[0], _ptr(x),
          x.size, _ptr(out))
    return out


def axpy_rows(weights, rows, y, impl="dispatch"):
    """y + sum_i weights[i] * rows[i, :n] (added row after row), n = len(y); returns a new y."""
    out = np.array(y, dtype=np.float32, copy=True, order="C")
    rows, type_name, stride = _cache_rows(rows, out.size)
    weights = _array(weights, np.float32)
    if weights.shape != (rows.shape[0],):
        raise ValueError(f"one weight per row: {rows.shape[0]} rows, weights {weights.shape}")
    _call(clib.load().kr_test_axpy_rows, _impl(impl), _weight_type(type_name), _ptr(weights), _ptr(rows), stride,
          rows.shape[0], _ptr(out), out.size)
    return out


def axpy_rows_q8_0(weights, blocks, y, impl="dispatch"):
    """y + sum_i weights[i] * dequantized row i, for rows of q8_0 blocks (uint8 (n_rows, len(y)/32*34),
    a KV cache q8_0 head): per element fma(weights[i] * d, q, y), row after row; returns a new y."""
    out = np.array(y, dtype=np.float32, copy=True, order="C")
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    weights = _array(weights, np.float32)
    if blocks.ndim != 2 or weights.shape != (blocks.shape[0],):
        raise ValueError(f"one weight per row of blocks: blocks {blocks.shape}, weights {weights.shape}")
    _call(clib.load().kr_test_axpy_rows, _impl(impl), WEIGHT_TYPES["q8_0"], _ptr(weights), _ptr(blocks),
          blocks.shape[1], blocks.shape[0], _ptr(out), out.size)
    return out


def _elementwise(which, x, y, impl, shift=0.0):
    x = np.array(x, dtype=np.float32, copy=True, order="C").reshape(-1)
    y = np.array(y, dtype=np.float32, copy=True, order="C").reshape(-1)
    if y.size not in (0, x.size):
        raise ValueError(f"the two vectors differ in length: {x.size} and {y.size}")
    total = ctypes.c_float()
    _call(clib.load().kr_test_elementwise, _impl(impl), which, _ptr(x), _ptr(y), x.size, ctypes.c_float(shift),
          ctypes.byref(total))
    return x, y, np.float32(total.value)


def exp(x, impl="dispatch"):
    """exp of float32 values with krafla's own exp (within 2 ulp; the same bits in every build)."""
    x = _array(x, np.float32).reshape(-1)
    return _elementwise(0, x, np.empty_like(x), impl)[1]


def exp_shift_sum(x, shift, impl="dispatch"):
    """(exp(x - shift), their float32 sum in the kernels' 8-lane order): a softmax's numerators."""
    values, _, total = _elementwise(1, x, np.empty(0, np.float32), impl, shift)
    return values, total


def silu_mul(gate, up, impl="dispatch"):
    """silu(gate) * up, element by element."""
    return _elementwise(2, gate, up, impl)[0]


def gelu_tanh_mul(gate, up, impl="dispatch"):
    """gelu_tanh(gate) * up, element by element."""
    return _elementwise(3, gate, up, impl)[0]


def delta_rule(state, q, k, v, beta, decay, impl="dispatch"):
    """One token of DeltaNet's delta rule on a (dv, dk) state S^T: (new state, out (dv,))."""
    state = np.array(state, dtype=np.float32, copy=True, order="C")
    q, k, v = (_array(a, np.float32) for a in (q, k, v))
    dv, dk = state.shape
    if q.shape != (dk,) or k.shape != (dk,) or v.shape != (dv,):
        raise ValueError(f"state {state.shape} needs q, k of ({dk},) and v of ({dv},)")
    out = np.empty(dv, np.float32)
    _call(clib.load().kr_test_delta_rule, _impl(impl), _ptr(state), dk, dv, _ptr(q), _ptr(k), _ptr(v),
          ctypes.c_float(beta), ctypes.c_float(decay), _ptr(out))
    return state, out


def bench_matmul(type_name, weights, rows, cols, x, impl="dispatch", repeat=20, packed=False):
    """Seconds of the fastest of `repeat` runs of (prepare activations + matmul over all rows), timed in C.

    packed: the weights are in the packed layout (from `pack`), multiplied by the packed matmul."""
    w = _array(weights, np.uint8)
    if w.size != rows * row_bytes(type_name, cols):
        raise ValueError(f"{rows}x{cols} {type_name} weights take {rows * row_bytes(type_name, cols)} bytes, got {w.size}")
    x = _array(x, np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"activations must be (n_tokens, {cols}), got {x.shape}")
    seconds = ctypes.c_double()
    _call(clib.load().kr_bench_matmul, _impl(impl), _weight_type(type_name), _ptr(w), int(packed), rows, cols, _ptr(x),
          x.shape[0], repeat, ctypes.byref(seconds))
    return seconds.value
