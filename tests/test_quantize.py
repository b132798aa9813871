"""Our numpy (de)quantizers against gguf-py's, which follow ggml's reference C code.

gguf-py (`gguf.quants`) is the independent check: our quantizers must give its blocks bit for bit,
and our dequantizers its floats bit for bit, on random, edge-case and real-model data.
"""

import struct

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from krafla_twisted.convert import quantize
from tests.strategies import weight_rows
from tests.support.real_models import NAMES, gguf_reader

GGML = gguf.GGMLQuantizationType


def reference_quantize(values, type_name):
    with np.errstate(all="ignore"):  # gguf-py warns on the f16 overflow of huge blocks
        return gguf.quants.quantize(values, GGML[type_name.upper()])


def as_bits(values):
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def edge_cases():
    rng = np.random.default_rng(7)
    halves = np.arange(-64, 64, dtype=np.float32).reshape(2, 64) + np.float32(0.5)
    halves[:, ::32] = 127.0  # q8_0 d = 1 exactly, so x/d lands on k + 0.5
    ties = np.zeros((1, 32), np.float32)
    ties[0, 3], ties[0, 9] = 2.0, -2.0  # equal magnitudes: the first one sets q4_0's sign
    negative_max = rng.standard_normal((3, 64)).astype(np.float32)
    negative_max[:, 5] = -10.0
    negative_max[:, 40] = -7.5
    single = np.zeros((1, 32), np.float32)
    single[0, 31] = 1e-3
    return {
        "zeros": np.zeros((2, 64), np.float32),
        "tiny": (rng.standard_normal((4, 64)) * 1e-30).astype(np.float32),
        "subnormal-scale": (rng.standard_normal((4, 64)) * 1e-6).astype(np.float32),
        "huge": (rng.standard_normal((4, 64)) * 1e30).astype(np.float32),
        "f16-overflow": (rng.standard_normal((4, 64)) * 1e7).astype(np.float32),
        "negative-maxima": negative_max,
        "ties": ties,
        "constant": np.full((2, 32), -3.0, np.float32),
        "halves": halves,
        "one-nonzero": single,
        "normal": rng.standard_normal((64, 256)).astype(np.float32),
    }


class QuantizerTests:
    """quantize_q8_0 / quantize_q4_0 / to_f16 give gguf-py's bytes exactly."""

    @pytest.mark.parametrize("case", sorted(edge_cases()))
    @pytest.mark.parametrize("type_name", ["q8_0", "q4_0", "f16"])
    def test_edge_cases_match_gguf_py(self, case, type_name):
        """Zeros, tiny, huge, negative maxima, magnitude ties and exact halves quantize like ggml."""
        values = edge_cases()[case]
        ours = quantize.QUANTIZERS[type_name](values)
        assert ours.dtype == np.uint8
        np.testing.assert_array_equal(ours, reference_quantize(values, type_name).view(np.uint8).reshape(ours.shape))

    @settings(max_examples=80, deadline=None)
    @given(weight_rows(), st.sampled_from(["q8_0", "q4_0", "f16"]))
    def test_any_finite_rows_match_gguf_py(self, values, type_name):
        """Finite float32 rows of any scale, with ties and halves (hypothesis), give gguf-py's bytes."""
        ours = quantize.QUANTIZERS[type_name](values)
        np.testing.assert_array_equal(ours, reference_quantize(values, type_name).view(np.uint8).reshape(ours.shape))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(st.integers(-127, 126), min_size=31, max_size=31), st.sampled_from([1.0, -1.0, 0.25, 4.0]))
    def test_exact_halves_match_gguf_py(self, steps, scale):
        """Blocks whose x/d are exactly k + 0.5 (d a power of two): q8_0 rounds them as ggml does."""
        values = np.array([[127.0] + [k + 0.5 for k in steps]], np.float32) * np.float32(scale)
        for type_name in ("q8_0", "q4_0"):
            np.testing.assert_array_equal(quantize.QUANTIZERS[type_name](values), reference_quantize(values, type_name))

    def test_roundf_rounds_halves_away_from_zero(self):
        """q8_0 rounds like C's roundf (2.5 -> 3, -2.5 -> -3, 0.49999997 -> 0), not to even."""
        values = np.zeros((1, 32), np.float32)
        values[0, :4] = [127.0, 2.5, -2.5, np.nextafter(np.float32(0.5), np.float32(0))]
        block = quantize.quantize_q8_0(values)[0]
        assert struct.unpack("<e", block[:2].tobytes())[0] == 1.0
        assert list(block[2:6].view(np.int8)) == [127, 3, -3, 0]

    def test_q4_0_layout(self):
        """q4_0: d = max / -8; byte j holds weight j (low nibble) and weight j + 16 (high nibble)."""
        values = np.zeros((1, 32), np.float32)
        values[0, 0], values[0, 16], values[0, 17] = -8.0, 4.0, 8.0
        block = quantize.quantize_q4_0(values)[0]
        assert struct.unpack("<e", block[:2].tobytes())[0] == 1.0
        assert block[2] == (0 | (12 << 4))  # -8 -> 0, 4 -> 12
        assert block[3] == (8 | (15 << 4))  # 0 -> 8, 8 -> 16 clamped to 15

    def test_bad_shapes_are_refused(self):
        """Rows that do not split into 32-weight blocks, and non-float32 input, are errors."""
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize.quantize_q4_0(np.zeros((1, 48), np.float32))
        with pytest.raises(ValueError, match="float32"):
            quantize.quantize_q8_0(np.zeros((1, 32), np.float64))


def random_blocks(type_name, rows, n_per_row, seed):
    """Random raw bytes of `type_name` with every f16 scale replaced by a finite value."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, quantize.row_bytes(type_name, n_per_row)), dtype=np.uint8)
    block, block_bytes = quantize.BLOCKS[type_name]
    blocks = raw.reshape(-1, block_bytes)
    scale_offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                     "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}.get(type_name, [])
    for offset in scale_offsets:
        scales = rng.uniform(-2, 2, blocks.shape[0]).astype("<f2")
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


class DequantizerTests:
    """dequantize() equals gguf-py's dequantize on every block type krafla reads."""

    @pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
    def test_random_blocks_match_gguf_py(self, type_name):
        """Random bits in every field (scales finite) decode to gguf-py's floats bit for bit."""
        raw = random_blocks(type_name, 5, 512, seed=len(type_name) + ord(type_name[1]))
        ours = quantize.dequantize(type_name, raw, 512)
        theirs = gguf.quants.dequantize(raw, GGML[type_name])
        np.testing.assert_array_equal(as_bits(ours), as_bits(theirs))

    def test_float_types_match_gguf_py(self):
        """F32, F16 and BF16 rows decode exactly (NaN/inf bits included for F32 and F16)."""
        rng = np.random.default_rng(3)
        bits = rng.integers(0, 1 << 16, (3, 64), dtype=np.uint16)
        bf16 = bits.view(np.uint8).reshape(3, -1)
        np.testing.assert_array_equal(as_bits(quantize.dequantize("BF16", bf16, 64)),
                                      as_bits(gguf.quants.dequantize(bf16, GGML.BF16)))
        f16 = bits.view(np.float16)
        np.testing.assert_array_equal(quantize.dequantize("F16", f16, 64), f16.astype(np.float32))
        f32 = rng.standard_normal((3, 64)).astype(np.float32)
        np.testing.assert_array_equal(quantize.dequantize("F32", f32, 64), f32)

    def test_q8_k_decodes_d_times_q(self):
        """Q8_K (f32 d, 256 x i8, 16 x i16 sums): weight i is d * q[i], read with struct."""
        raw = random_blocks("Q8_K", 2, 512, seed=11)
        raw.reshape(-1, 292)[:, 0:4] = np.array([0.5, -1.25, 3.0, 0.125], "<f4").view(np.uint8).reshape(4, 4)
        expected = []
        for block in raw.reshape(-1, 292):
            (d,) = struct.unpack("<f", block[:4].tobytes())
            expected.extend(np.float32(d) * np.float32(q) for q in struct.unpack("<256b", block[4:260].tobytes()))
        np.testing.assert_array_equal(quantize.dequantize("Q8_K", raw, 512).reshape(-1), np.array(expected, np.float32))

    def test_quantize_then_dequantize_is_close(self):
        """q8_0 round trips stay within half a step (plus the f16 rounding of the scale); q4_0
        within one step, since its positive side stops at +7 steps when the maximum is negative."""
        values = np.random.default_rng(5).standard_normal((8, 128)).astype(np.float32)
        for type_name, encode, steps, bound in (("Q8_0", quantize.quantize_q8_0, 127, 0.5 + 127 / 2048),
                                                ("Q4_0", quantize.quantize_q4_0, 8, 1.0)):
            back = quantize.dequantize(type_name, encode(values), 128)
            step = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True) / steps
            assert (np.abs(back - values).reshape(-1, 32) <= step * bound).all(), type_name

    def test_unsupported_and_malformed_input_is_refused(self):
        """An unknown type names the supported ones; a wrong row size says what was expected."""
        with pytest.raises(quantize.UnsupportedType, match="Q9_Z is not supported.*Q6_K"):
            quantize.dequantize("Q9_Z", np.zeros((1, 84), np.uint8), 256)
        with pytest.raises(ValueError, match="expected 18 for 32 weights"):
            quantize.dequantize("Q4_0", np.zeros((1, 20), np.uint8), 32)


@pytest.mark.parametrize("name", NAMES)
def test_real_model_tensors_dequantize_like_gguf_py(name):
    """Every tensor of the three real GGUFs dequantizes to gguf-py's floats bit for bit.

    Matrices of over 2048 rows are checked on their first and last 1024 rows (rows decode
    independently, and every block type and layer is still covered), to keep the suite quick."""
    reader = gguf_reader(name)
    types = set()
    for tensor in reader.tensors:
        n_per_row = int(tensor.shape[0])
        raw = np.asarray(tensor.data)
        raw = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1)
        if raw.shape[0] > 2048:
            raw = np.concatenate([raw[:1024], raw[-1024:]])
        ours = quantize.dequantize(tensor.tensor_type.name, raw, n_per_row)
        theirs = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(ours.shape)
        assert np.array_equal(as_bits(ours), as_bits(theirs)), tensor.name
        types.add(tensor.tensor_type.name)
    expected_types = {"smollm2-135m": {"F32", "Q4_1", "Q8_0"},
                      "qwen2.5-coder-0.5b": {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"},
                      "gemma3-270m": {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}}[name]
    assert types == expected_types
