"""numpy dequantizers for GGUF's block types and quantizers to krafla's q8_0, q4_0 and the low-bit
types q2_K, q3_K, iq4_nl, iq4_xs and mxfp4.

Written from ggml's block layouts (ggml-common.h / ggml-quants.c). Every function works on rows:
a block type's raw data is a uint8 array of shape (rows, row_bytes) and the float data is
float32 of shape (rows, n_per_row). The float arithmetic is done in float32 in the order ggml's
reference C code uses, so the results are the same bits as ggml's (and gguf-py's).

Block layouts (QK_K = 256 weights per super-block):

    Q4_0  32 w, 18 B:  f16 d, u8 qs[16]               w = d * (nibble - 8)
    Q4_1  32 w, 20 B:  f16 d, f16 m, u8 qs[16]        w = d * nibble + m
    Q5_0  32 w, 22 B:  f16 d, u32 qh, u8 qs[16]       w = d * ((nibble | high bit << 4) - 16)
    Q5_1  32 w, 24 B:  f16 d, f16 m, u32 qh, qs[16]   w = d * (nibble | high bit << 4) + m
    Q8_0  32 w, 34 B:  f16 d, i8 qs[32]               w = d * q
    Q4_K 256 w, 144 B: f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min), u8 qs[128]
    Q5_K 256 w, 176 B: f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
    Q6_K 256 w, 210 B: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
    Q8_K 256 w, 292 B: f32 d, i8 qs[256], i16 bsums[16]
    Q2_K 256 w, 84 B:  u8 scales[16] (4-bit scale | 4-bit min << 4, per 16 w), u8 qs[64] (2 bits), f16 d, f16 dmin
    Q3_K 256 w, 110 B: u8 hmask[32], u8 qs[64] (2 bits), u8 scales[12] (16 x 6-bit), f16 d
    IQ4_NL 32 w, 18 B: f16 d, u8 qs[16]              w = d * kvalues_iq4nl[nibble]
    IQ4_XS 256 w, 136 B: f16 d, u16 scales_h, u8 scales_l[4] (8 x 6-bit, per 32 w), u8 qs[128]
    MXFP4  32 w, 17 B: u8 e (E8M0), u8 qs[16]        w = 2^(e - 128) * kvalues_mxfp4[nibble]

In the 4-bit types byte j of qs holds weight j in its low nibble and weight j + 16 (of the same
32-weight block) in its high nibble. The K-quants split a super-block into 32-weight sub-blocks,
each with its own 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) scale.
"""

import numpy as np

QK = 32
QK_K = 256

# name -> (weights per block, bytes per block)
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (QK, 18),
    "Q4_1": (QK, 20),
    "Q5_0": (QK, 22),
    "Q5_1": (QK, 24),
    "Q8_0": (QK, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "Q8_K": (QK_K, 292),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "IQ4_NL": (QK, 18),
    "IQ4_XS": (QK_K, 136),
    "MXFP4": (QK, 17),
}


class UnsupportedType(ValueError):
    """A tensor type this converter cannot read."""


def _f16(raw):
    """Little-endian f16 bytes (..., 2) -> float32 (...)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _blocks(raw, n_per_row, type_name):
    """Check a (rows, row_bytes) uint8 array and view it as (rows * blocks, block_bytes)."""
    block, block_bytes = BLOCKS[type_name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(f"{type_name}: expected a 2-D uint8 array, got {raw.dtype} {raw.shape}")
    if n_per_row % block:
        raise ValueError(f"{type_name}: {n_per_row} weights per row is not a multiple of {block}")
    if raw.shape[1] != n_per_row // block * block_bytes:
        raise ValueError(f"{type_name}: {raw.shape[1]} bytes per row, expected "
                         f"{n_per_row // block * block_bytes} for {n_per_row} weights")
    return np.ascontiguousarray(raw).reshape(-1, block_bytes)


def _nibbles(qs):
    """u8 (n, 16) -> u8 (n, 32): low nibbles are weights 0..15, high nibbles weights 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh_bytes):
    """Q5_0/Q5_1 u32 qh as bytes (n, 4) -> u8 (n, 32): bit j of qh is the fifth bit of weight j."""
    qh = np.ascontiguousarray(qh_bytes).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _dequant_q4_0(b):
    d = _f16(b[:, 0:2])[:, None]
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _dequant_q4_1(b):
    d = _f16(b[:, 0:2])[:, None]
    m = _f16(b[:, 2:4])[:, None]
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return d * q + m


def _dequant_q5_0(b):
    d = _f16(b[:, 0:2])[:, None]
    q = (_nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _dequant_q5_1(b):
    d = _f16(b[:, 0:2])[:, None]
    m = _f16(b[:, 2:4])[:, None]
    q = (_nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)).astype(np.float32)
    return d * q + m


def _dequant_q8_0(b):
    d = _f16(b[:, 0:2])[:, None]
    q = np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32)
    return d * q


def _k_scales_mins(scales):
    """Q4_K/Q5_K packed scales u8 (n, 12) -> 6-bit scales (n, 8) and mins (n, 8).

    Sub-blocks 0..3: scale = s[j] & 63, min = s[j + 4] & 63. Sub-blocks 4..7: the low four bits
    come from s[j + 4] (scale low nibble, min high nibble), the top two from bits 6..7 of
    s[j - 4] (scale) and s[j] (min)."""
    s = scales
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_quads(qs):
    """Q4_K/Q5_K qs u8 (n, 128) -> 4-bit values (n, 8, 32) in weight order.

    Each 32-byte group g holds sub-block 2g in its low nibbles and 2g + 1 in its high ones."""
    groups = qs.reshape(-1, 4, 32)
    return np.stack([groups & 0x0F, groups >> 4], axis=2).reshape(-1, 8, 32)


def _dequant_q4_k(b):
    d = _f16(b[:, 0:2])[:, None]
    dmin = _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    q = _k_quads(b[:, 16:144]).astype(np.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def _dequant_q5_k(b):
    d = _f16(b[:, 0:2])[:, None]
    dmin = _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    low = _k_quads(b[:, 48:176])
    # qh[l] bit i is the fifth bit of weight l of sub-block i.
    high = (b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).astype(np.float32)
    return (scale * q - offset).reshape(-1, QK_K)


def _dequant_q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # (n, half, row of 32 bytes, l)
    qh = b[:, 128:192].reshape(-1, 2, 32)  # (n, half, l)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])[:, None]
    # Within each 128-weight half, quarter k (32 weights) takes nibble k // 2 of ql row k % 2
    # and bits 2k..2k+1 of qh.
    low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    # One int8 scale per 16 weights: (n, 16) in weight order.
    scale = (d * sc).reshape(-1, 2, 4, 2, 1)
    return (scale * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, QK_K)


def _dequant_q8_k(b):
    d = np.ascontiguousarray(b[:, 0:4]).view("<f4").astype(np.float32)
    q = np.ascontiguousarray(b[:, 4:260]).view(np.int8).astype(np.float32)
    return d * q


_DEQUANTIZERS = {
    "Q4_0": _dequant_q4_0,
    "Q4_1": _dequant_q4_1,
    "Q5_0": _dequant_q5_0,
    "Q5_1": _dequant_q5_1,
    "Q8_0": _dequant_q8_0,
    "Q4_K": _dequant_q4_k,
    "Q5_K": _dequant_q5_k,
    "Q6_K": _dequant_q6_k,
    "Q8_K": _dequant_q8_k,
}

SUPPORTED = ("F32", "F16", "BF16") + tuple(_DEQUANTIZERS)


def _gguf_type(type_name):
    """gguf-py's GGMLQuantizationType for a type our own code does not read (IQ-quants, Q2_K,
    Q3_K, ...), or None when gguf-py cannot dequantize it either."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, type_name, None)
    return qtype if qtype is not None and qtype in gguf.GGML_QUANT_SIZES else None


def readable(type_name):
    """Whether `dequantize` reads GGUF type `type_name`: ours, else gguf-py's dequantizers."""
    return type_name in SUPPORTED or _gguf_type(type_name) is not None


def row_bytes(type_name, n_per_row):
    """Bytes one row of `n_per_row` weights takes in `type_name`."""
    if type_name in BLOCKS:
        block, block_bytes = BLOCKS[type_name]
    elif _gguf_type(type_name) is not None:
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[_gguf_type(type_name)]
    else:
        raise UnsupportedType(f"tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED)})")
    return n_per_row // block * block_bytes


def dequantize(type_name, raw, n_per_row):
    """Raw rows of `type_name` (uint8 (rows, row_bytes), or a typed array for F32/F16) -> float32 (rows, n_per_row)."""
    if type_name not in SUPPORTED:
        qtype = _gguf_type(type_name)
        if qtype is None:
            raise UnsupportedType(f"tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED)})")
        # A type only gguf-py reads (IQ-quants, Q2_K, Q3_K, ...): its dequantizer, for --type.
        from gguf import quants

        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        if raw.ndim != 2 or raw.shape[1] != row_bytes(type_name, n_per_row):
            raise ValueError(f"{type_name}: expected rows of {row_bytes(type_name, n_per_row)} bytes, got {raw.shape}")
        return quants.dequantize(raw, qtype).astype(np.float32).reshape(raw.shape[0], n_per_row)
    raw = np.asarray(raw)
    if type_name in ("F32", "F16", "BF16") and raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1)
    blocks = _blocks(raw, n_per_row, type_name)
    rows = raw.shape[0]
    if type_name == "F32":
        return blocks.view("<f4").reshape(rows, n_per_row).astype(np.float32)
    if type_name == "F16":
        return blocks.view("<f2").reshape(rows, n_per_row).astype(np.float32)
    if type_name == "BF16":
        return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, n_per_row)
    return _DEQUANTIZERS[type_name](blocks).reshape(rows, n_per_row)


def _check_rows(x):
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"expected a 2-D float32 array, got {x.dtype} {x.shape}")
    if x.shape[1] % QK:
        raise ValueError(f"{x.shape[1]} weights per row is not a multiple of {QK}")
    return np.ascontiguousarray(x).reshape(-1, QK)


def _roundf(x):
    """C's roundf: to nearest, halves away from zero (numpy's round goes to even).

    Not floor(|x| + 0.5): in float32 that rounds 0.49999997 up. The fraction |x| - floor(|x|)
    is exact, so comparing it with 0.5 is too."""
    magnitude = np.abs(x)
    whole = np.floor(magnitude)
    return np.copysign(whole + (magnitude - whole >= np.float32(0.5)), x)


def quantize_q8_0(x):
    """float32 (rows, n) -> q8_0 bytes (rows, n / 32 * 34), as ggml's quantize_row_q8_0_ref.

    d = max|x| / 127, q = roundf(x / d) (computed as x * (1 / d)), d stored as f16."""
    blocks = _check_rows(x)
    rows = x.shape[0]
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", over="ignore"):  # 1 / subnormal d is inf, as in ggml
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):  # a subnormal d gives inf/NaN, as in ggml
        q = _roundf(blocks * inverse).astype(np.int8)
    out = np.empty((blocks.shape[0], 34), np.uint8)
    with np.errstate(over="ignore"):
        out[:, 0:2] = d.astype("<f2").view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(rows, -1)


def quantize_q4_0(x):
    """float32 (rows, n) -> q4_0 bytes (rows, n / 32 * 18), as ggml's quantize_row_q4_0_ref.

    The weight of largest magnitude (the first one on ties), with its sign, maps to -8:
    d = max / -8, nibble = min(15, trunc(x / d + 8.5)), d stored as f16."""
    blocks = _check_rows(x)
    rows = x.shape[0]
    first_largest = np.abs(blocks).argmax(axis=1)[:, None]
    signed_max = np.take_along_axis(blocks, first_largest, axis=1)
    d = signed_max / np.float32(-8)
    with np.errstate(divide="ignore", over="ignore"):  # 1 / subnormal d is inf, as in ggml
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.minimum(np.trunc(blocks * inverse + np.float32(8.5)), np.float32(15)).astype(np.uint8)
    out = np.empty((blocks.shape[0], 18), np.uint8)
    with np.errstate(over="ignore"):
        out[:, 0:2] = d.astype("<f2").view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.reshape(rows, -1)


def to_f16(x):
    """float32 -> f16 bytes, rounding to nearest even as ggml's fp32->fp16 does."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(x.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# The low-bit types (engine_c/src/kernels/lowbit.h). Straightforward quantizers: each block's scales
# from its extremes (iq4_nl and iq4_xs refined once by least squares), every weight to the nearest
# level its block can hold. They write ggml's layouts, which gguf-py and llama.cpp read.

KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _check_super_rows(x):
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"expected a 2-D float32 array, got {x.dtype} {x.shape}")
    if x.shape[1] % QK_K:
        raise ValueError(f"{x.shape[1]} weights per row is not a multiple of {QK_K}")
    return np.ascontiguousarray(x).reshape(-1, QK_K)


def _f16_round(x):
    """float32 -> the nearest f16, back as float32 (what a stored scale is)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype("<f2").astype(np.float32)


def _f16_bytes(x):
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(np.asarray(x, np.float32).astype("<f2")).view(np.uint8).reshape(-1, 2)


def _safe_divide(x, d):
    """x / d, 0 where d is 0."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.where(d == 0, np.float32(0), x / np.where(d == 0, np.float32(1), d)).astype(np.float32)


def _signed_max(x):
    """The element of largest magnitude along the last axis (the first on ties), with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _nearest(scaled, grid):
    """Index into the sorted `grid` of the value nearest each of `scaled`, the lower on ties: how many
    midpoints between neighbours lie below it."""
    midpoints = (grid[:-1] + grid[1:]) / np.float32(2)
    return np.searchsorted(midpoints, scaled, side="left").astype(np.uint8)


def _pack_nibbles(indices):
    """(..., 32) indices -> (..., 16) bytes: byte l holds index l (low nibble) and l + 16 (high)."""
    return (indices[..., :16] | (indices[..., 16:] << 4)).astype(np.uint8)


def _grid_scale(x):
    """A float scale per group of the last axis for the iq4_nl grid: the largest magnitude maps to -127,
    then one least-squares step with the levels it picked, keeping whichever gives less error."""
    first = _signed_max(x) / np.float32(-127)
    levels = KVALUES_IQ4NL[_nearest(_safe_divide(x, first[..., None]), KVALUES_IQ4NL)]
    with np.errstate(divide="ignore", invalid="ignore"):
        fitted = ((levels * x).sum(axis=-1) / (levels * levels).sum(axis=-1)).astype(np.float32)
    candidates = []
    for d in (first, np.where(np.isfinite(fitted), fitted, first).astype(np.float32)):
        chosen = KVALUES_IQ4NL[_nearest(_safe_divide(x, d[..., None]), KVALUES_IQ4NL)]
        candidates.append((((d[..., None] * chosen - x) ** 2).sum(axis=-1), d))
    return np.where(candidates[1][0] < candidates[0][0], candidates[1][1], candidates[0][1]).astype(np.float32)


def quantize_iq4_nl(x):
    """float32 (rows, n) -> iq4_nl bytes (rows, n / 32 * 18): per block of 32 an f16 scale d and the
    nearest of d * kvalues_iq4nl for each weight."""
    blocks = _check_rows(x)
    d = _f16_round(_grid_scale(blocks))
    indices = _nearest(_safe_divide(blocks, d[:, None]), KVALUES_IQ4NL)
    out = np.empty((blocks.shape[0], 18), np.uint8)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:] = _pack_nibbles(indices)
    return out.reshape(x.shape[0], -1)


def quantize_iq4_xs(x):
    """float32 (rows, n) -> iq4_xs bytes (rows, n / 256 * 136): sub-blocks of 32 take iq4_nl's grid with
    a 6-bit scale (-32..31) of one f16 d per 256 weights."""
    blocks = _check_super_rows(x)
    sub = blocks.reshape(-1, 8, 32)
    scales = _grid_scale(sub)
    d = _f16_round(_signed_max(scales) / np.float32(-32))
    levels = np.clip(np.rint(_safe_divide(scales, d[:, None])), -32, 31).astype(np.int32)
    sub_scale = d[:, None] * levels.astype(np.float32)  # the engine's d * scale
    indices = _nearest(_safe_divide(sub, sub_scale[:, :, None]), KVALUES_IQ4NL)
    stored = (levels + 32).astype(np.uint32)
    out = np.empty((blocks.shape[0], 136), np.uint8)
    out[:, 0:2] = _f16_bytes(d)
    scales_h = ((stored >> 4) << (2 * np.arange(8, dtype=np.uint32))).sum(axis=1).astype("<u2")
    out[:, 2:4] = scales_h.view(np.uint8).reshape(-1, 2)
    low = (stored & 15).astype(np.uint8)
    out[:, 4:8] = low[:, 0::2] | (low[:, 1::2] << 4)
    out[:, 8:] = _pack_nibbles(indices).reshape(-1, 128)
    return out.reshape(x.shape[0], -1)


def quantize_mxfp4(x):
    """float32 (rows, n) -> mxfp4 bytes (rows, n / 32 * 17): the OCP microscaling choice of exponent,
    e = floor(log2(max |x|)) - 2 + 127 (0 for a zero block), and the nearest of 2^(e - 128) *
    kvalues_mxfp4 for each weight (the first index on ties)."""
    blocks = _check_rows(x)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2 + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    d = bits.view(np.float32)
    indices = np.zeros(blocks.shape, np.uint8)
    best = np.full(blocks.shape, np.inf, np.float32)
    for index, level in enumerate(KVALUES_MXFP4):  # |d * level - x|, the first level on ties
        error = np.abs(d[:, None] * level - blocks)
        better = error < best
        indices[better] = index
        best = np.where(better, error, best)
    out = np.empty((blocks.shape[0], 17), np.uint8)
    out[:, 0] = e.astype(np.uint8)
    out[:, 1:] = _pack_nibbles(indices)
    return out.reshape(x.shape[0], -1)


def _pack_two_bits(q):
    """(n, 256) values 0..3 -> (n, 64) bytes: byte 32h + l holds weight 128h + 32s + l in bits 2s."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def quantize_q2_K(x):
    """float32 (rows, n) -> q2_K bytes (rows, n / 256 * 84): per 16 weights an affine 2-bit grid from
    min(min, 0) to the max, its scale and min in 4 bits of one f16 d and dmin per 256 weights."""
    blocks = _check_super_rows(x)
    sub = blocks.reshape(-1, 16, 16)
    low = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - low) / np.float32(3)
    mins = -low
    d = _f16_round(scale.max(axis=1) / np.float32(15))
    dmin = _f16_round(mins.max(axis=1) / np.float32(15))
    sc = np.clip(np.rint(_safe_divide(scale, d[:, None])), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(_safe_divide(mins, dmin[:, None])), 0, 15).astype(np.uint8)
    step = d[:, None] * sc.astype(np.float32)
    offset = dmin[:, None] * m.astype(np.float32)
    q = np.clip(np.rint(_safe_divide(sub + offset[:, :, None], step[:, :, None])), 0, 3)
    out = np.empty((blocks.shape[0], 84), np.uint8)
    out[:, 0:16] = sc | (m << 4)
    out[:, 16:80] = _pack_two_bits(q.reshape(-1, QK_K))
    out[:, 80:82] = _f16_bytes(d)
    out[:, 82:84] = _f16_bytes(dmin)
    return out.reshape(x.shape[0], -1)


def quantize_q3_K(x):
    """float32 (rows, n) -> q3_K bytes (rows, n / 256 * 110): per 16 weights the levels -4..3 of a scale
    that maps the largest magnitude to -4, in 6 bits (-32..31) of one f16 d per 256 weights."""
    blocks = _check_super_rows(x)
    sub = blocks.reshape(-1, 16, 16)
    scale = _signed_max(sub) / np.float32(-4)
    d = _f16_round(_signed_max(scale) / np.float32(-32))
    levels = np.clip(np.rint(_safe_divide(scale, d[:, None])), -32, 31).astype(np.int32)
    step = d[:, None] * levels.astype(np.float32)
    q = (np.clip(np.rint(_safe_divide(sub, step[:, :, None])), -4, 3) + 4).astype(np.uint8).reshape(-1, QK_K)
    out = np.zeros((blocks.shape[0], 110), np.uint8)
    high = (q >> 2).reshape(-1, 8, 32)  # weight 32k + l: bit k of hmask[l]
    out[:, 0:32] = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    out[:, 32:96] = _pack_two_bits(q & 3)
    stored = (levels + 32).astype(np.uint8)
    out[:, 96:104] = (stored[:, :8] & 15) | ((stored[:, 8:] & 15) << 4)
    top = (stored >> 4).reshape(-1, 4, 4)  # scale j: bits 2 (j // 4) of byte 8 + j % 4
    out[:, 104:108] = (top << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1).astype(np.uint8)
    out[:, 108:110] = _f16_bytes(d)
    return out.reshape(x.shape[0], -1)


QUANTIZERS = {
    "q8_0": quantize_q8_0,
    "q4_0": quantize_q4_0,
    "f16": to_f16,
    "q2_K": quantize_q2_K,
    "q3_K": quantize_q3_K,
    "iq4_nl": quantize_iq4_nl,
    "iq4_xs": quantize_iq4_xs,
    "mxfp4": quantize_mxfp4,
}
