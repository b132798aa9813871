"""ggml's k-quants (q4_K, q5_K, q6_K) and q8_K written in numpy, independently of krafla's C code.

- `encode(weights, type_name)`: float32 (rows, cols) -> the file layout's bytes (rows, row bytes). A
  plain min/max quantizer (not ggml's search for the best scales): tests need valid blocks whose
  values follow the weights, not ggml's exact choice of blocks.
- `random_blocks(rng, type_name, rows, cols)`: blocks with random quants, scales and mins.
- `quantize_q8_K(x)`: ggml's quantize_row_q8_K_ref in numpy (d, q, bsums).
- `packed(type_name, data, rows, cols)`: the packed layout that kernels.h and kquant_ref.c describe.
"""

import numpy as np

SUPER_BLOCK = 256
BLOCK_BYTES = {"q4_K": 144, "q5_K": 176, "q6_K": 210}
PACK_ROWS = 8
SLICE_BLOCKS, SLICE_ABOVE = 16, 20  # kernels.h, KR_SLICE_BLOCKS and KR_SLICE_ABOVE


def _f16_bytes(values):
    return np.asarray(values, np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)


def pack_scales_mins(sc, m):
    """(n, 8) six-bit scales and mins -> (n, 12) bytes, ggml's packing (get_scale_min_k4's inverse)."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _nibbles_q45(q):
    """(n, 256) quants 0..31 -> qs (n, 128) and qh (n, 32): byte 32c + l holds weights 64c + l and 64c + 32 + l."""
    n = q.shape[0]
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)
    high = (q >> 4).reshape(n, 8, 32)  # bit s of qh[l]: weight 32s + l
    qh = np.zeros((n, 32), np.uint8)
    for s in range(8):
        qh |= (high[:, s] << s).astype(np.uint8)
    return qs.reshape(n, 128).astype(np.uint8), qh


def assemble_q45(type_name, d, dmin, sc, m, q):
    """Blocks from their fields: d, dmin (n,), sc, m (n, 8) in 0..63, q (n, 256) in 0..15 or 0..31."""
    qs, qh = _nibbles_q45(q.astype(np.uint8))
    parts = [_f16_bytes(d), _f16_bytes(dmin), pack_scales_mins(sc, m)]
    if type_name == "q5_K":
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def assemble_q6(d, scales, q):
    """q6_K blocks from d (n,), scales (n, 16) int8, q (n, 256) in 0..63."""
    n = q.shape[0]
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # half, part, l: weight 128h + 32p + l
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1).astype(np.uint8)


def encode(weights, type_name):
    """float32 (rows, cols), cols a multiple of 256 -> uint8 (rows, cols / 256 * block bytes)."""
    w = np.asarray(weights, np.float32)
    rows, cols = w.shape
    if cols % SUPER_BLOCK:
        raise ValueError(f"{type_name} rows need a multiple of {SUPER_BLOCK} columns, got {cols}")
    x = w.reshape(-1, SUPER_BLOCK).astype(np.float64)
    n = x.shape[0]
    if type_name == "q6_K":
        sub = x.reshape(n, 16, 16)
        amax_index = np.abs(sub).argmax(axis=2)
        signed_max = np.take_along_axis(sub, amax_index[..., None], axis=2)[..., 0]
        scale = -signed_max / 32  # the largest magnitude maps to -32
        d = np.abs(scale).max(axis=1) / 127
        d16 = d.astype(np.float16).astype(np.float64)
        sc = np.clip(np.round(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), -127, 127)
        step = d16[:, None] * sc
        q = np.round(np.divide(sub, step[..., None], out=np.zeros_like(sub), where=step[..., None] != 0))
        q = np.clip(q, -32, 31) + 32
        blocks = assemble_q6(d16, sc, q.reshape(n, SUPER_BLOCK))
    else:
        nmax = 15 if type_name == "q4_K" else 31
        sub = x.reshape(n, 8, 32)
        low = np.minimum(sub.min(axis=2), 0.0)
        scale = (sub.max(axis=2) - low) / nmax
        minimum = -low
        d = scale.max(axis=1) / 63
        dmin = minimum.max(axis=1) / 63
        d16 = d.astype(np.float16).astype(np.float64)
        dmin16 = dmin.astype(np.float16).astype(np.float64)
        sc = np.clip(np.round(np.divide(scale, d16[:, None], out=np.zeros_like(scale), where=d16[:, None] > 0)), 0, 63)
        m = np.clip(np.round(np.divide(minimum, dmin16[:, None], out=np.zeros_like(minimum), where=dmin16[:, None] > 0)), 0, 63)
        step = d16[:, None] * sc
        shifted = sub + (dmin16[:, None] * m)[..., None]
        q = np.clip(np.round(np.divide(shifted, step[..., None], out=np.zeros_like(sub), where=step[..., None] > 0)), 0, nmax)
        blocks = assemble_q45(type_name, d16, dmin16, sc, m, q.reshape(n, SUPER_BLOCK))
    return blocks.reshape(rows, -1)


def random_blocks(rng, type_name, rows, cols, extremes=False):
    """Blocks with uniformly random quants, scales and mins (d, dmin of varied size; with `extremes`
    every quant, scale and min at its largest, the activations' worst case for the integer sums)."""
    n = rows * cols // SUPER_BLOCK
    d = np.exp(rng.uniform(-12, -2, n)) * rng.choice([-1.0, 1.0], n)
    if type_name == "q6_K":
        scales = rng.integers(-128, 128, (n, 16))
        q = rng.integers(0, 64, (n, SUPER_BLOCK))
        if extremes:
            scales = np.where(rng.random((n, 16)) < 0.5, -128, 127)
            q = np.where(rng.random((n, SUPER_BLOCK)) < 0.5, 0, 63)
        return assemble_q6(d, scales, q).reshape(rows, -1)
    nmax = 15 if type_name == "q4_K" else 31
    dmin = np.exp(rng.uniform(-12, -2, n)) * rng.choice([-1.0, 1.0], n)
    sc, m = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
    q = rng.integers(0, nmax + 1, (n, SUPER_BLOCK))
    if extremes:
        sc, m, q = np.full_like(sc, 63), np.full_like(m, 63), np.full_like(q, nmax)
    return assemble_q45(type_name, d, dmin, sc, m, q).reshape(rows, -1)


def quantize_q8_K(x):
    """ggml's quantize_row_q8_K_ref in float32 numpy: per 256 values, max = the first value of the
    largest magnitude, iscale = -127 / max, q = min(127, round-half-even(iscale * x)),
    d = 1 / iscale, bsums = sums of 16; an all-zero block is d = 0, q = 0.
    Returns (d float32 (n,), q int8 (n, 256), bsums int16 (n, 16))."""
    blocks = np.asarray(x, np.float32).reshape(-1, SUPER_BLOCK)
    index = np.abs(blocks).argmax(axis=1)
    signed_max = blocks[np.arange(blocks.shape[0]), index]
    zero = signed_max == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), signed_max)).astype(np.float32)
        q = np.minimum(np.rint(iscale[:, None] * blocks), 127).astype(np.int8)
        d = np.where(zero, np.float32(0), np.float32(1.0) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    bsums = q.reshape(-1, 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return d, q, bsums


def slice_blocks(type_name, n_blocks):
    """Super-blocks per column slice (kernels.h, kr_slice_blocks): q4_K rows of more than 20 are cut
    into the fewest slices of at most 16, all of one length but the last."""
    if type_name != "q4_K" or n_blocks <= SLICE_ABOVE:
        return n_blocks
    slices = -(-n_blocks // SLICE_BLOCKS)
    return -(-n_blocks // slices)


def packed(type_name, data, rows, cols):
    """The packed layout built from its description: column slice after column slice (one unless
    the rows are long), for each whole group of 8 rows, super-block by super-block of the slice, the
    group super-block below; the rows past the last group as they are."""
    size = BLOCK_BYTES[type_name]
    n_blocks = cols // SUPER_BLOCK
    blocks = np.asarray(data, np.uint8).reshape(rows, n_blocks, size)
    grouped = rows - rows % PACK_ROWS
    per_slice = slice_blocks(type_name, n_blocks)
    out = []
    for slice_start in range(0, n_blocks, per_slice):
        for first in range(0, grouped, PACK_ROWS):
            for b in range(slice_start, min(slice_start + per_slice, n_blocks)):
                out += group_superblock(type_name, blocks[first:first + PACK_ROWS, b])
    out.append(blocks[grouped:].reshape(-1))
    return np.concatenate(out).astype(np.uint8)


def group_superblock(type_name, g):
    """The packed group super-block of 8 rows' super-blocks g (8, bytes), as a list of byte arrays."""

    def chunks(fields):  # (8, bytes) -> chunk i = bytes 4i..4i+3 of each row, row after row
        return fields.reshape(PACK_ROWS, -1, 4).transpose(1, 0, 2).reshape(-1)

    if type_name == "q6_K":
        ql, qh = chunks(g[:, 0:128]).reshape(32, 32), chunks(g[:, 128:192]).reshape(16, 32)
        out = [g[:, 208:210].reshape(-1), g[:, 192:208].T.reshape(-1)]
        for h in range(2):  # per half: qh's chunks each followed by ql's of the same weights, then ql's other 8
            out += [chunk for i in range(8) for chunk in (qh[8 * h + i], ql[16 * h + i])]
            out += [ql[16 * h + 8 + i] for i in range(8)]
        return out
    scales = g[:, 4:16]
    sc = np.concatenate([scales[:, 0:4] & 63, (scales[:, 8:12] & 15) | ((scales[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([scales[:, 4:8] & 63, (scales[:, 8:12] >> 4) | ((scales[:, 4:8] >> 6) << 4)], axis=1)
    scale_bytes = (sc | ((m >> 4) << 6)).T.reshape(-1)  # byte 8j + r
    min_nibbles = ((m[:, 0:4] & 15) | ((m[:, 4:8] & 15) << 4)).T.reshape(-1)  # byte 8k + r
    qs = g[:, 48:176] if type_name == "q5_K" else g[:, 16:144]
    out = [g[:, 0:2].reshape(-1), g[:, 2:4].reshape(-1), scale_bytes.astype(np.uint8), min_nibbles.astype(np.uint8)]
    if type_name == "q5_K":  # each chunk of fifth bits followed by the first 64 weights' chunk, then the rest
        qh, quants = chunks(g[:, 16:48]).reshape(8, 32), chunks(qs).reshape(32, 32)
        return out + [chunk for i in range(8) for chunk in (qh[i], quants[i])] + list(quants[8:])
    return out + [chunks(qs)]


def dequantize(data, type_name):
    """Blocks (any shape, whole blocks) -> float32 values, ggml's dequantize_row_q*_K: the scale and
    min products in float32 first, then d * sc * q - dmin * m (q6_K: d * sc * (q - 32))."""
    blocks = np.asarray(data, np.uint8).reshape(-1, BLOCK_BYTES[type_name])
    n = blocks.shape[0]
    if type_name == "q6_K":
        ql, qh = blocks[:, 0:128].reshape(n, 2, 2, 32), blocks[:, 128:192].reshape(n, 2, 32)
        scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = blocks[:, 208:210].copy().view("<f2").astype(np.float32)
        parts = [ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4]  # weight 128h + 32p + l
        q = np.stack([parts[p] | (((qh >> (2 * p)) & 3) << 4) for p in range(4)], axis=2).reshape(n, 16, 16)
        return ((d * scales)[..., None] * (q.astype(np.float32) - 32)).reshape(-1)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
    s = blocks[:, 4:16]
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1).astype(np.float32)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1).astype(np.float32)
    qs = (blocks[:, 48:176] if type_name == "q5_K" else blocks[:, 16:144]).reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)  # sub-block 2c: low nibbles, 2c + 1: high
    if type_name == "q5_K":
        qh = blocks[:, 16:48]
        q = q | np.stack([((qh >> s) & 1) << 4 for s in range(8)], axis=1)
    return ((d * sc)[..., None] * q.astype(np.float32) - (dmin * m)[..., None]).reshape(-1)
