"""The low-bit weight types q2_K, q3_K, iq4_nl, iq4_xs and mxfp4 (engine_c/src/kernels/lowbit.h).

What is pinned, and against what:
- Dequantization: bit for bit against gguf-py's numpy dequantizers, on random blocks.
- The reference matmul: against numpy in float64 (gguf-py's decoding of the weights times the
  values of the prepared activations: q8_K for the super-block types, q8_0 for the blocks of 32)
  within FLOAT32_SUM_TOLERANCE.
- The AVX2 (in an ISA=avx512 build, the 512-bit and VNNI) matmul equals the reference at zero
  tolerance, for any number of tokens and any row range, also with every quant, scale and
  activation at its extreme. iq4_nl and mxfp4 are packed (legacy.h's layout, built independently
  here in numpy): every implementation on packed weights gives the file layout reference's bits,
  mxfp4's extreme exponents included, and a packed row looks up as gguf-py's dequantized row; the
  super-block types are not packed (kr_test_pack refuses them).
- The quantizers of `krafla convert --type` write blocks gguf-py decodes close to the weights
  (mxfp4: gguf-py's own quantizer's bytes), and a GGUF holding these types converts with its
  blocks kept, then loads and runs, giving logits close to its f32 dequantization's.
"""

import io
import re

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.cli import info
from krafla_twisted.convert import quantize
from krafla_twisted.convert.gguf import convert_gguf
from krafla_twisted.engine import clib, formats, kernels
from krafla_twisted.engine.container import ContainerFile
from tests.test_kernels import float32_sum_tolerance, random_float32, same_bits
from tests.test_kquant import q8_K_values

GGML = gguf.GGMLQuantizationType
GGUF_TYPES = {"q2_K": GGML.Q2_K, "q3_K": GGML.Q3_K, "iq4_nl": GGML.IQ4_NL, "iq4_xs": GGML.IQ4_XS, "mxfp4": GGML.MXFP4}
TYPES = tuple(GGUF_TYPES)
SUPER = ("q2_K", "q3_K", "iq4_xs")
PACKED = ("iq4_nl", "mxfp4")
PACK_ROWS = 8
# mxfp4's exponents at their edges (e < 2 subnormal scales, 254 and 255 the largest) and in the middle
EDGE_EXPONENTS = np.array([0, 1, 2, 3, 100, 127, 128, 129, 140, 253, 254, 255], np.uint8)
# Where each block keeps its f16 scales (ggml-common.h); mxfp4's first byte is its E8M0 exponent.
F16_SCALES = {"q2_K": (80, 82), "q3_K": (108,), "iq4_nl": (0,), "iq4_xs": (0,), "mxfp4": ()}
SETTINGS = settings(max_examples=25, deadline=None)


def implementations():
    return ("reference", "avx2", "dispatch") if kernels.has_avx2() else ("reference", "dispatch")


def block_of(type_name):
    return formats.TENSOR_TYPES_BY_NAME[type_name].block


def random_blocks(rng, type_name, rows, cols, exponents=(0, 256)):
    """(rows, row bytes) of random bytes with finite f16 scales of varied size and sign (mxfp4: an
    exponent drawn from `exponents`)."""
    tensor_type = formats.TENSOR_TYPES_BY_NAME[type_name]
    n = rows * cols // tensor_type.block
    data = rng.integers(0, 256, (n, tensor_type.block_bytes), dtype=np.uint8)
    for offset in F16_SCALES[type_name]:
        scale = np.exp(rng.uniform(-12, -2, n)) * rng.choice([-1.0, 1.0], n)
        data[:, offset:offset + 2] = scale.astype("<f2").view(np.uint8).reshape(n, 2)
    if type_name == "mxfp4":
        data[:, 0] = rng.integers(*exponents, n)
    return data.reshape(rows, -1)


def q8_0_values(x):
    """The values of the q8_0 blocks the blocks-of-32 types are multiplied with (d * q)."""
    blocks = kernels.quantize_q8_0(x, "reference").reshape(-1, 34)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float64)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float64)
    return (d * q).reshape(x.shape)


@st.composite
def problems(draw):
    """(type, rows, cols, n_tokens, row_begin, row_end, seed): odd row counts (tiles of 4 rows), 1 to 4
    blocks or super-blocks per row (blocks of 32: up to 12), 1 to 9 tokens, any row range."""
    type_name = draw(st.sampled_from(TYPES))
    rows = draw(st.integers(1, 13))
    row_begin = draw(st.integers(0, rows - 1))
    cols = block_of(type_name) * draw(st.integers(1, 4 if type_name in SUPER else 12))
    return (type_name, rows, cols, draw(st.integers(1, 9)), row_begin, draw(st.integers(row_begin + 1, rows)),
            draw(st.integers(0, 2**32 - 1)))


class DequantizeTests:
    @SETTINGS
    @given(type_name=st.sampled_from(TYPES), n_blocks=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
    def test_matches_gguf_bit_for_bit(self, type_name, n_blocks, seed):
        """kr_dequantize_row gives gguf-py's values exactly, every exponent of mxfp4 included."""
        n = block_of(type_name) * n_blocks
        data = random_blocks(np.random.default_rng(seed), type_name, 1, n)
        with np.errstate(over="ignore"):  # mxfp4's largest exponents times 12 overflow float32, in both
            expected = gguf_dequantize(data.reshape(n_blocks, -1), GGUF_TYPES[type_name]).reshape(-1).astype(np.float32)
        assert same_bits(kernels.dequantize(type_name, data.reshape(-1), n), expected)

    def test_type_table(self):
        """The C library's names and sizes are ggml's (gguf-py's GGML_QUANT_SIZES), with the numbering of krafla.h."""
        from krafla_twisted.engine import container
        from krafla_twisted.engine.model import supported_weight_types

        codes = {"q2_K": 13, "q3_K": 14, "iq4_nl": 15, "iq4_xs": 16, "mxfp4": 17}
        for type_name, qtype in GGUF_TYPES.items():
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            assert formats.TENSOR_TYPES_BY_NAME[type_name].code == codes[type_name]
            assert container.type_name(codes[type_name]) == type_name
            assert container.type_size(codes[type_name], 4 * block) == 4 * block_bytes
            assert container.type_size(codes[type_name], block + 1) == 0
            assert type_name in supported_weight_types()


class MatmulTests:
    @SETTINGS
    @given(problem=problems())
    def test_every_implementation_equals_the_reference(self, problem):
        """Every implementation, any row range: the reference's bits; a token alone gives its bits in the batch."""
        type_name, rows, cols, n_tokens, row_begin, row_end, seed = problem
        rng = np.random.default_rng(seed)
        weights = random_blocks(rng, type_name, rows, cols, exponents=(100, 140))
        x = random_float32(rng, (n_tokens, cols))
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference", row_begin, row_end)
        for impl in implementations():
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl, row_begin, row_end), reference), impl
        alone = kernels.matmul(type_name, weights, rows, cols, x[-1:], "dispatch", row_begin, row_end)
        assert same_bits(alone, reference[-1:])

    @SETTINGS
    @given(problem=problems())
    def test_reference_matches_numpy_within_tolerance(self, problem):
        """The reference equals W @ x in float64 from gguf-py's decoding of the weights and the values of
        the prepared activations, within FLOAT32_SUM_TOLERANCE over the blocks' terms."""
        type_name, rows, cols, n_tokens, _, _, seed = problem
        rng = np.random.default_rng(seed)
        weights = random_blocks(rng, type_name, rows, cols, exponents=(100, 140))
        x = random_float32(rng, (n_tokens, cols))
        w64 = gguf_dequantize(weights, GGUF_TYPES[type_name]).reshape(rows, cols).astype(np.float64)
        x64 = q8_K_values(x) if type_name in SUPER else q8_0_values(x)
        expected = x64 @ w64.T
        tolerance = float32_sum_tolerance(np.abs(x64) @ np.abs(w64).T, 2 * (cols // block_of(type_name)) + 8)
        got = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        assert np.all(np.abs(got - expected) <= tolerance), np.max(np.abs(got - expected) - tolerance)

    @pytest.mark.parametrize("type_name", TYPES)
    def test_integer_sums_stay_exact_at_the_extremes(self, type_name):
        """Every nibble at the grid's largest magnitude (or bytes of all ones), scales at their extremes,
        activations of +-127: no int16 step overflows, so every implementation equals the reference."""
        rows, cols = 9, 512
        weights = random_blocks(np.random.default_rng(1), type_name, rows, cols, exponents=(120, 121))
        blocks = weights.reshape(-1, formats.TENSOR_TYPES_BY_NAME[type_name].block_bytes)
        keep = {offset + i for offset in F16_SCALES[type_name] for i in (0, 1)} | ({0} if type_name == "mxfp4" else set())
        fill = 0x00 if type_name in ("iq4_nl", "iq4_xs") else 0x77 if type_name == "mxfp4" else 0xFF
        for column in range(blocks.shape[1]):
            if column not in keep:
                blocks[:, column] = fill  # iq4: -127 everywhere, mxfp4: 12, q2_K/q3_K: all bits set
        if type_name == "q3_K":
            blocks[:, 96:108] = 0x00  # every scale -32, every hmask bit set: q = 3
        x = np.where(np.random.default_rng(2).random((3, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
        x[1] = 1.0
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        w64 = gguf_dequantize(weights, GGUF_TYPES[type_name]).reshape(rows, cols).astype(np.float64)
        x64 = q8_K_values(x) if type_name in SUPER else q8_0_values(x)
        assert np.allclose(reference, x64 @ w64.T, rtol=1e-5)
        for impl in implementations():
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl), reference), impl
        if type_name in PACKED:  # the packed tiles' int16 pairs (plain AVX2) at the same extremes
            packed = kernels.pack(type_name, weights, rows, cols)
            for impl in implementations():
                assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl), reference), impl

    @pytest.mark.parametrize("type_name, rows, cols, n_tokens", [
        ("q2_K", 37, 2304, 21), ("q3_K", 18, 1536, 9), ("iq4_xs", 23, 4864, 6), ("iq4_nl", 29, 896, 40),
        ("mxfp4", 31, 2880, 11)])
    def test_large_shapes_agree(self, type_name, rows, cols, n_tokens):
        """Projection-sized problems: every implementation equals the reference."""
        rng = np.random.default_rng(3)
        weights = random_blocks(rng, type_name, rows, cols, exponents=(110, 130))
        x = random_float32(rng, (n_tokens, cols))
        reference = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        for impl in implementations():
            assert same_bits(kernels.matmul(type_name, weights, rows, cols, x, impl), reference), impl

    @pytest.mark.parametrize("type_name", SUPER)
    def test_not_packed(self, type_name):
        """The super-block low-bit types keep the file layout: kr_test_pack refuses them with a message."""
        weights = random_blocks(np.random.default_rng(4), type_name, 8, 256)
        with pytest.raises(clib.KraflaError, match="packed"):
            kernels.pack(type_name, weights, 8, 256)


def numpy_packed(type_name, data, rows, cols):
    """legacy.h's packed layout of iq4_nl and mxfp4, built with numpy: whole groups of 8 rows where
    they are in the file, the rows past the last group as they are; in a group, block by block, the
    8 rows' scales (iq4_nl: 2 bytes each, mxfp4: its exponent byte), then 4 chunks of nibbles, chunk i
    holding bytes 4i..4i+3 of each row's 16."""
    size = formats.TENSOR_TYPES_BY_NAME[type_name].block_bytes
    scale = size - 16
    blocks = np.asarray(data, np.uint8).reshape(rows, cols // 32, size)
    grouped = rows - rows % PACK_ROWS
    out = []
    for first in range(0, grouped, PACK_ROWS):
        for b in range(cols // 32):
            block = blocks[first:first + PACK_ROWS, b, :]  # (8, size)
            out.append(block[:, :scale].reshape(-1))
            out.append(block[:, scale:].reshape(PACK_ROWS, 4, 4).transpose(1, 0, 2).reshape(-1))
    out.append(blocks[grouped:].reshape(-1))
    return np.concatenate(out)


@st.composite
def packed_problems(draw):
    """(type, rows, cols, n_tokens, row_begin, row_end, seed) for the packed types: rows 1 to 40 (whole
    groups of 8, pairs of groups of 16 and the rows past them), 1 to 12 blocks, 1 to 9 tokens."""
    type_name = draw(st.sampled_from(PACKED))
    rows = draw(st.integers(1, 40))
    row_begin = draw(st.integers(0, rows - 1))
    return (type_name, rows, 32 * draw(st.integers(1, 12)), draw(st.integers(1, 9)), row_begin,
            draw(st.integers(row_begin + 1, rows)), draw(st.integers(0, 2**32 - 1)))


def packable_blocks(rng, type_name, rows, cols):
    """random_blocks with mxfp4's exponents drawn from EDGE_EXPONENTS."""
    weights = random_blocks(rng, type_name, rows, cols)
    if type_name == "mxfp4":
        weights.reshape(-1, 17)[:, 0] = rng.choice(EDGE_EXPONENTS, rows * cols // 32)
    return weights


class PackedTests:
    @SETTINGS
    @given(problem=packed_problems())
    def test_layout_matches_the_documented_one(self, problem):
        """kr_pack_rows writes exactly the layout legacy.h describes, at the file layout's size."""
        type_name, rows, cols, _, _, _, seed = problem
        weights = packable_blocks(np.random.default_rng(seed), type_name, rows, cols)
        got = kernels.pack(type_name, weights, rows, cols).reshape(-1)
        assert got.size == weights.size
        assert np.array_equal(got, numpy_packed(type_name, weights, rows, cols))

    @SETTINGS
    @given(problem=packed_problems())
    def test_packed_matmul_equals_the_reference(self, problem):
        """Every implementation on packed weights, any row range, several tokens and one (the one-token
        tiles differ): the file layout reference's bits, mxfp4's extreme exponents included."""
        type_name, rows, cols, n_tokens, row_begin, row_end, seed = problem
        rng = np.random.default_rng(seed)
        weights = packable_blocks(rng, type_name, rows, cols)
        x = random_float32(rng, (n_tokens, cols))
        want = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        packed = kernels.pack(type_name, weights, rows, cols)
        for impl in implementations():
            for tokens in (x, x[:1]):
                got = kernels.matmul_packed(type_name, packed, rows, cols, tokens, impl, row_begin, row_end)
                assert same_bits(got[:, row_begin:row_end], want[:len(tokens), row_begin:row_end]), (impl, len(tokens))
                assert np.isnan(got[:, :row_begin]).all() and np.isnan(got[:, row_end:]).all()

    @pytest.mark.parametrize("type_name, rows, cols, n_tokens", [("iq4_nl", 61, 4864, 21), ("mxfp4", 37, 2880, 9),
                                                                 ("mxfp4", 768, 2048, 1)])
    def test_large_shapes_agree(self, type_name, rows, cols, n_tokens):
        """Projection-sized problems (several L2 blocks of activations, an expert's 768 rows): packed
        gives the reference's bits in every implementation."""
        rng = np.random.default_rng(8)
        weights = random_blocks(rng, type_name, rows, cols, exponents=(110, 130))
        x = random_float32(rng, (n_tokens, cols))
        want = kernels.matmul(type_name, weights, rows, cols, x, "reference")
        packed = kernels.pack(type_name, weights, rows, cols)
        for impl in implementations():
            assert same_bits(kernels.matmul_packed(type_name, packed, rows, cols, x, impl), want), impl

    @SETTINGS
    @given(type_name=st.sampled_from(PACKED), rows=st.integers(1, 27), blocks=st.integers(1, 4),
           seed=st.integers(0, 2**32 - 1))
    def test_packed_row_is_the_dequantized_row(self, type_name, rows, blocks, seed):
        """Every row of a packed matrix, in a group of 8 or past the last one: gguf-py's dequantized
        file row, bit for bit."""
        cols = 32 * blocks
        weights = packable_blocks(np.random.default_rng(seed), type_name, rows, cols)
        with np.errstate(over="ignore"):
            want = gguf_dequantize(weights.reshape(rows * blocks, -1), GGUF_TYPES[type_name]).reshape(rows, cols)
        packed = kernels.pack(type_name, weights, rows, cols)
        for row in range(rows):
            assert same_bits(kernels.dequantize_packed(type_name, packed, rows, cols, row), want[row].astype(np.float32)), row


class QuantizerTests:
    @pytest.mark.parametrize("type_name, error", [("q2_K", 0.36), ("q3_K", 0.18), ("iq4_nl", 0.09),
                                                  ("iq4_xs", 0.09), ("mxfp4", 0.13)])
    def test_gguf_reads_what_the_quantizer_writes(self, type_name, error):
        """The bytes of `convert --type` decode (by gguf-py) to values close to the weights: root mean
        square error of normal weights below the type's bound, and a zero row stays zero."""
        w = np.random.default_rng(5).standard_normal((6, 768)).astype(np.float32)
        w[2] = 0.0
        data = quantize.QUANTIZERS[type_name](w)
        assert data.shape == (6, formats.TENSOR_TYPES_BY_NAME[type_name].nbytes((768,)))
        values = gguf_dequantize(data, GGUF_TYPES[type_name]).reshape(w.shape)
        assert np.sqrt(np.mean((values - w) ** 2)) < error
        assert not values[2].any()
        assert same_bits(kernels.dequantize(type_name, data[0], 768), values[0])

    def test_mxfp4_is_gguf_pys_quantizer(self):
        """mxfp4's choice of exponent and levels is the OCP one gguf-py implements: the same bytes."""
        w = random_float32(np.random.default_rng(6), (5, 320))
        assert np.array_equal(quantize.quantize_mxfp4(w).reshape(-1), gguf.quants.quantize(w, GGML.MXFP4).reshape(-1))


def write_low_bit_gguf(path, monkeypatch, types):
    """tests/test_convert's tiny GGUF (dim 256) with the matrices of `types` (name -> type) quantized by
    krafla's quantizers (gguf-py has none for these types but mxfp4's): gguf-py's writer stores the blocks."""
    from tests.test_convert import write_gguf

    original = gguf.quants.quantize
    ours = {qtype: quantize.QUANTIZERS[name] for name, qtype in GGUF_TYPES.items()}
    monkeypatch.setattr(gguf.quants, "quantize", lambda data, qtype: ours[qtype](data) if qtype in ours else original(data, qtype))
    values = {name: (0.1 * np.random.default_rng(7).standard_normal(shape)).astype(np.float32)
              for name, shape in (("blk.0.attn_q.weight", (32, 256)), ("blk.0.attn_k.weight", (16, 256)),
                                  ("blk.0.attn_v.weight", (16, 256)), ("blk.0.ffn_gate.weight", (64, 256)),
                                  ("blk.0.ffn_up.weight", (64, 256)))}
    path = write_gguf(path, dim=256, values=values, encode={name: type_name.upper() for name, type_name in types.items()})
    monkeypatch.undo()
    return path


def evaluate(path, tokens):
    """Every token's logits, one session of a model opened (and packed) as the server opens it."""
    from krafla_twisted.engine.model import Model

    with Model(path) as model:
        session = model.session(ctx=16)
        return session.eval_all(tokens)


class ModelFileTests:
    def test_kept_loaded_and_run(self, tmp_path, monkeypatch):
        """`convert` keeps every low-bit matrix's blocks byte for byte and `krafla info` lists their
        types; the model loads (packed: iq4_nl and mxfp4 packed, the
        super-block types in the file layout) and its logits are close to those of the same GGUF
        converted to f32 (gguf-py's dequantization), the first tokens' bits the same alone."""
        types = {"blk.0.attn_q.weight": "q2_K", "blk.0.attn_k.weight": "q3_K", "blk.0.attn_v.weight": "iq4_xs",
                 "blk.0.ffn_gate.weight": "iq4_nl", "blk.0.ffn_up.weight": "mxfp4"}
        source = write_low_bit_gguf(tmp_path / "m.gguf", monkeypatch, types)
        mlb, _ = convert_gguf(source, tmp_path / "kept.mlb", tmp_path / "kept.mlt", progress=False)
        f32, _ = convert_gguf(source, tmp_path / "f32.mlb", tmp_path / "f32.mlt", "f32", progress=False)
        kept = formats.read(mlb).tensors
        for tensor in gguf.GGUFReader(source).tensors:
            if tensor.name in types:
                assert kept[tensor.name].type.name == types[tensor.name]
                assert np.array_equal(kept[tensor.name].data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))
        report = io.StringIO()
        with ContainerFile(str(mlb)) as loaded:
            info.describe(loaded, report)
        for name, type_name in types.items():
            assert re.search(rf"{re.escape(name)}\s+{type_name}\s", report.getvalue()), name
        tokens = [1, 4, 6, 5, 7, 3]
        logits, expected = evaluate(mlb, tokens), evaluate(f32, tokens)
        assert np.isfinite(logits).all()
        assert same_bits(evaluate(mlb, tokens[:3]), logits[:3])
        cosine = (logits * expected).sum(axis=1) / np.linalg.norm(logits, axis=1) / np.linalg.norm(expected, axis=1)
        assert cosine.min() > 0.99, cosine

    @pytest.mark.parametrize("type_name", TYPES)
    def test_convert_type_writes_the_type(self, tmp_path, type_name):
        """`convert --type T` stores the matrices as T (rows of 32 weights as iq4_nl for the super-block
        types, as llama-quantize falls back), the head as q8_0, and the model runs."""
        from tests.test_convert import write_gguf

        source = write_gguf(tmp_path / "m.gguf", dim=256)
        mlb, _ = convert_gguf(source, tmp_path / "t.mlb", tmp_path / "t.mlt", type_name, progress=False)
        tensors = formats.read(mlb).tensors
        assert tensors["blk.0.ffn_up.weight"].type.name == type_name
        assert tensors["blk.0.attn_output.weight"].type.name == ("iq4_nl" if type_name in SUPER else type_name)
        assert tensors["token_embd.weight"].type is formats.Q8_0
        assert np.isfinite(evaluate(mlb, [1, 4, 5])).all()
