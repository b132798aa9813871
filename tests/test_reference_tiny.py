"""Properties of the numpy reference (tests/support/reference.py) on tiny random models.

The reference is what the C engine is judged against, so its own conventions are pinned here by
properties that a wrong implementation breaks: causality, the exact sliding-window boundary,
grouped-query attention against a per-head loop, RoPE's two pair layouts being one rotation under
llama.cpp's q/k row permutation, the rotation itself against complex multiplication, and the
dequantizers against gguf-py. tests/reference/test_transformers.py checks the whole forward pass
against Hugging Face transformers on the real models.
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from krafla_twisted.engine import formats
from tests.support import reference
from tests.support.reference import ReferenceModel
from tests.support.tiny_models import encode, tiny_model_container

ARCHS = ("llama", "qwen2", "gemma3")


def write(tmp_path, container, name="model.mlb"):
    path = tmp_path / name
    formats.write(path, container)
    return ReferenceModel(path)


def tiny(tmp_path, arch, seed=1, name="model.mlb", **overrides):
    return write(tmp_path, tiny_model_container(arch, seed=seed, **overrides), name)


def replace_f32(container, name, values):
    container.add(name, formats.F32, values.shape, values.astype(np.float32))


class CausalityTests:
    @pytest.mark.parametrize("arch", ARCHS)
    def test_later_tokens_do_not_change_earlier_logits(self, tmp_path, arch):
        """Logits at positions before i are unchanged when tokens from i on change, and those
        at i change: attention is causal, and the comparison would see a leak."""
        model = tiny(tmp_path, arch)
        first = [5, 9, 2, 33, 17, 8, 21, 40, 3, 11]
        second = first[:6] + [1, 2, 60, 7]
        a, b = model.forward(first), model.forward(second)
        np.testing.assert_allclose(a[:6], b[:6], rtol=1e-6, atol=1e-6)
        assert np.abs(a[6:] - b[6:]).max(axis=1).min() > 1e-3

    @pytest.mark.parametrize("arch", ARCHS)
    def test_greedy_with_cache_equals_recomputing_every_step(self, tmp_path, arch):
        """greedy() runs the prompt once and then one token at a time through its key/value
        cache; it picks the same tokens as the argmax of a full forward of the growing text."""
        model = tiny(tmp_path, arch, seed=4)
        prompt = [3, 14, 15, 9, 26]
        tokens = list(prompt)
        for _ in range(6):
            tokens.append(int(np.argmax(model.forward(tokens)[-1])))
        assert model.greedy(prompt, 6) == tokens[len(prompt):]

    def test_last_logits_is_the_last_row_of_forward(self, tmp_path):
        """last_logits(ids) equals forward(ids)[-1]."""
        model = tiny(tmp_path, "gemma3")
        ids = [1, 2, 3, 4, 5, 6, 7]
        np.testing.assert_allclose(model.last_logits(ids), model.forward(ids)[-1], rtol=1e-6, atol=1e-6)


class SlidingWindowTests:
    WINDOW = 4

    def sliding_model(self, tmp_path, n_layers, **overrides):
        return tiny(tmp_path, "gemma3", n_layers=n_layers, sliding_window=self.WINDOW,
                    layer_types=[1] * n_layers, **overrides)

    def influence(self, model, ids, position):
        """How much the last position's logits move when the token at `position` changes."""
        changed = list(ids)
        changed[position] = (changed[position] + 29) % model.n_vocab
        return np.abs(model.last_logits(ids) - model.last_logits(changed)).max()

    def test_one_layer_sees_exactly_the_window(self, tmp_path):
        """With one sliding layer of window 4, the last token's logits depend on the tokens at
        distance 0..3 and not on the one at distance 4 (the token itself plus window - 1 before
        it, as transformers and llama.cpp mask)."""
        model = self.sliding_model(tmp_path, 1)
        ids = [7, 1, 22, 5, 13, 30, 2, 19, 11, 4]
        last = len(ids) - 1
        assert self.influence(model, ids, last - self.WINDOW) == 0
        assert self.influence(model, ids, last - self.WINDOW - 2) == 0
        for distance in range(1, self.WINDOW):
            assert self.influence(model, ids, last - distance) > 1e-4, distance

    def test_stacked_layers_reach_back_layers_times_window_minus_one(self, tmp_path):
        """Two sliding layers of window 4 reach 2 * 3 = 6 tokens back, and no further."""
        model = self.sliding_model(tmp_path, 2)
        ids = [7, 1, 22, 5, 13, 30, 2, 19, 11, 4, 9, 16]
        last = len(ids) - 1
        assert self.influence(model, ids, last - 6) > 1e-6
        assert self.influence(model, ids, last - 7) == 0

    def test_full_attention_layer_sees_everything(self, tmp_path):
        """A full-attention layer (type 0) in the same model ignores the window."""
        model = tiny(tmp_path, "gemma3", n_layers=1, sliding_window=self.WINDOW, layer_types=[0])
        ids = [7, 1, 22, 5, 13, 30, 2, 19, 11, 4]
        assert self.influence(model, ids, 0) > 1e-4

    def test_sliding_layers_use_the_local_rope_base(self, tmp_path):
        """Sliding layers rotate with rope_theta_local and without rope_scale: an all-sliding
        model with a window longer than the text equals an all-full model whose rope_theta is
        that local base."""
        sliding = tiny(tmp_path, "gemma3", name="sliding.mlb", sliding_window=1000, layer_types=[1, 1, 1],
                       rope_theta=1e6, rope_theta_local=500.0, rope_scale=4.0)
        full = tiny(tmp_path, "gemma3", name="full.mlb", sliding_window=1000, layer_types=[0, 0, 0],
                    rope_theta=500.0, rope_theta_local=1e6, rope_scale=1.0)
        ids = list(range(3, 40, 3))
        np.testing.assert_allclose(sliding.forward(ids), full.forward(ids), rtol=1e-6, atol=1e-6)
        wrong = tiny(tmp_path, "gemma3", name="wrong.mlb", sliding_window=1000, layer_types=[0, 0, 0],
                     rope_theta=1e6)
        assert np.abs(wrong.forward(ids) - full.forward(ids)).max() > 1e-3


def per_head_attention(q, k, v, scale):
    """Attention written as loops: head by head, query by query, over the keys up to it."""
    n, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros((n, n_heads, head_dim))
    for head in range(n_heads):
        kv_head = head // group
        for i in range(n):
            scores = np.array([q[i, head] @ k[j, kv_head] * scale for j in range(i + 1)])
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[i, head] = sum(weights[j] * v[j, kv_head] for j in range(i + 1))
    return out.reshape(n, -1)


class GroupedQueryAttentionTests:
    @pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
    def test_vectorized_attention_equals_a_per_head_loop(self, n_kv_heads):
        """The vectorized causal attention equals the loop over heads and queries, for
        n_kv_heads equal to n_heads and for groups of 2 and 4 query heads per kv head."""
        rng = np.random.default_rng(3)
        q = rng.standard_normal((7, 4, 8))
        k = rng.standard_normal((7, n_kv_heads, 8))
        v = rng.standard_normal((7, n_kv_heads, 8))
        positions = np.arange(7)
        got = reference.attention(q, k, v, positions, positions, 0.3, 0, 0.0)
        np.testing.assert_allclose(got, per_head_attention(q, k, v, 0.3), rtol=1e-12, atol=1e-12)

    @pytest.mark.parametrize("arch", ARCHS)
    def test_shared_kv_heads_equal_duplicated_ones(self, tmp_path, arch):
        """A GQA model equals the same model with each key/value head's rows copied for every
        query head of its group (consecutive query heads share a kv head, as in transformers'
        repeat_kv and llama.cpp)."""
        container = tiny_model_container(arch, seed=2, n_heads=4, n_kv_heads=2)
        grouped = write(tmp_path, container, "grouped.mlb")
        head_dim = container.metadata["head_dim"]
        container.metadata["n_kv_heads"] = 4
        for layer in range(container.metadata["n_layers"]):
            for name in ("attn_k.weight", "attn_v.weight", "attn_k.bias", "attn_v.bias"):
                full_name = f"blk.{layer}.{name}"
                if full_name not in container.tensors:
                    continue
                values = container.array(full_name)
                heads = values.reshape(2, head_dim, *values.shape[1:])
                replace_f32(container, full_name, np.repeat(heads, 2, axis=0).reshape(4 * head_dim, *values.shape[1:]))
        duplicated = write(tmp_path, container, "duplicated.mlb")
        ids = [4, 8, 15, 16, 23, 42]
        np.testing.assert_allclose(grouped.forward(ids), duplicated.forward(ids), rtol=1e-6, atol=1e-6)


def permute_for_norm_style(weights, n_heads, rope_dims):
    """llama.cpp's q/k row permutation (convert_hf_to_gguf's `permute`), restricted to the
    first rope_dims rows of each head: row i of the rotated half-split layout moves to 2i, row
    i + rope_dims/2 to 2i + 1."""
    rows = weights.reshape(n_heads, -1, *weights.shape[1:])
    rotated = rows[:, :rope_dims].reshape(n_heads, 2, rope_dims // 2, *weights.shape[1:])
    rotated = rotated.swapaxes(1, 2).reshape(n_heads, rope_dims, *weights.shape[1:])
    return np.concatenate([rotated, rows[:, rope_dims:]], axis=1).reshape(weights.shape)


class RopeTests:
    @pytest.mark.parametrize("arch", ARCHS)
    @pytest.mark.parametrize("partial", [False, True])
    def test_norm_and_neox_are_one_rotation_under_the_permutation(self, tmp_path, arch, partial):
        """A neox-style model equals the norm-style model whose q/k rows (and biases, and q/k
        norm weights) are permuted as llama.cpp's converter permutes llama; with partial rotary
        dimensions only the rotated rows move. Without the permutation the logits differ."""
        head_dim = tiny_model_container(arch, seed=5).metadata["head_dim"]
        rope_dims = head_dim // 2 if partial else head_dim
        container = tiny_model_container(arch, seed=5, rope_style="neox", rope_dims=rope_dims)
        neox = write(tmp_path, container, "neox.mlb")
        container.metadata["rope_style"] = "norm"
        unpermuted = write(tmp_path, container, "unpermuted.mlb")
        meta = container.metadata
        for layer in range(meta["n_layers"]):
            for name, heads in (("attn_q", meta["n_heads"]), ("attn_k", meta["n_kv_heads"])):
                for suffix in (".weight", ".bias"):
                    full_name = f"blk.{layer}.{name}{suffix}"
                    if full_name in container.tensors:
                        permuted = permute_for_norm_style(container.array(full_name), heads, rope_dims)
                        replace_f32(container, full_name, permuted)
                norm_name = f"blk.{layer}.{name}_norm.weight"
                if norm_name in container.tensors:
                    replace_f32(container, norm_name, permute_for_norm_style(container.array(norm_name), 1, rope_dims))
        norm = write(tmp_path, container, "norm.mlb")
        ids = [2, 7, 1, 8, 28, 18, 28, 45, 9]
        np.testing.assert_allclose(neox.forward(ids), norm.forward(ids), rtol=1e-5, atol=1e-5)
        assert np.abs(unpermuted.forward(ids) - neox.forward(ids)).max() > 1e-3

    @pytest.mark.parametrize("style", ["norm", "neox"])
    def test_rotation_is_complex_multiplication(self, style):
        """Pair i at position p is multiplied by exp(1j * p / scale * theta^(-2i/rope_dims)),
        with the pair's first element as the real part; dimensions past rope_dims stay."""
        rng = np.random.default_rng(0)
        head_dim, rope_dims, theta, scale = 12, 8, 100.0, 2.5
        x = rng.standard_normal((5, 3, head_dim))
        positions = np.array([0, 1, 4, 9, 100])
        got = reference.rope(x, positions, theta, scale, style, rope_dims)
        if style == "norm":
            first, second = np.arange(0, rope_dims, 2), np.arange(1, rope_dims, 2)
        else:
            first, second = np.arange(rope_dims // 2), np.arange(rope_dims // 2, rope_dims)
        for p_index, position in enumerate(positions):
            for i in range(rope_dims // 2):
                turn = np.exp(1j * position / scale * theta ** (-2 * i / rope_dims))
                pair = (x[p_index, :, first[i]] + 1j * x[p_index, :, second[i]]) * turn
                np.testing.assert_allclose(got[p_index, :, first[i]], pair.real, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(got[p_index, :, second[i]], pair.imag, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(got[..., rope_dims:], x[..., rope_dims:])


    def test_rope_scale_divides_positions(self):
        """rope_scale s at position p rotates as scale 1 at position p / s."""
        x = np.random.default_rng(1).standard_normal((3, 2, 8))
        scaled = reference.rope(x, np.array([0, 4, 8]), 1e4, 4.0, "neox", 8)
        plain = reference.rope(x, np.array([0, 1, 2]), 1e4, 1.0, "neox", 8)
        np.testing.assert_allclose(scaled, plain, rtol=1e-12, atol=1e-12)
        assert np.abs(scaled - x).max() > 1e-3


class SoftcapTests:
    def test_final_softcap_is_tanh_of_the_uncapped_logits(self, tmp_path):
        """final_softcap c turns logits z into c * tanh(z / c)."""
        plain = tiny(tmp_path, "gemma3", name="plain.mlb")
        capped = tiny(tmp_path, "gemma3", name="capped.mlb", final_softcap=0.5)
        ids = [3, 1, 4, 1, 5]
        z = plain.forward(ids).astype(np.float64)
        np.testing.assert_allclose(capped.forward(ids), 0.5 * np.tanh(z / 0.5), rtol=1e-5, atol=1e-6)

    def test_attention_softcap_bounds_the_scores(self):
        """attn_softcap c caps every score at c before the softmax: huge q.k gives the same
        weights as scores of exactly c."""
        q = np.full((2, 1, 4), 100.0)
        k = np.array([[[1.0, 1, 1, 1]], [[-1.0, -1, -1, -1]]])
        v = np.array([[[1.0, 0, 0, 0]], [[0.0, 1, 0, 0]]])
        out = reference.attention(q, k, v, np.arange(2), np.arange(2), 1.0, 0, 2.0)
        expected = np.exp(2.0) / (np.exp(2.0) + np.exp(-2.0))
        np.testing.assert_allclose(out[1, :2], [expected, 1 - expected], rtol=1e-12)


class DequantizeTests:
    @pytest.mark.parametrize("type_name, gguf_type", [
        ("f16", GGMLQuantizationType.F16), ("bf16", GGMLQuantizationType.BF16),
        ("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0),
        ("q4_K", GGMLQuantizationType.Q4_K), ("q5_K", GGMLQuantizationType.Q5_K), ("q6_K", GGMLQuantizationType.Q6_K)])
    def test_dequantize_equals_gguf_py(self, type_name, gguf_type):
        """Every .mlb weight type dequantizes to exactly gguf-py's values (the blocks are GGUF's)."""
        rng = np.random.default_rng(11)
        weights = rng.standard_normal((6, 256 if type_name.endswith("_K") else 96)).astype(np.float32) * np.float32(3)
        tensor_type, data = encode(weights, type_name)
        container = formats.Container(formats.MODEL_MAGIC)
        container.add("w", tensor_type, weights.shape, data)
        tensor = container.tensors["w"]
        expected = gguf_dequantize(tensor.data, gguf_type).reshape(weights.shape)
        np.testing.assert_array_equal(reference.dequantize(tensor), expected)


    @pytest.mark.parametrize("type_name, gguf_type", [
        ("q4_1", GGMLQuantizationType.Q4_1), ("q5_0", GGMLQuantizationType.Q5_0), ("q5_1", GGMLQuantizationType.Q5_1)])
    def test_ggml_32_blocks_are_exact(self, type_name, gguf_type):
        """q4_1, q5_0 and q5_1 dequantize to the blocks' exact values d * q + m in float64: within
        one float32 rounding of gguf-py's values (which round d * q and then the sum), and equal to
        them where gguf-py's float32 arithmetic is exact (q5_0, and every d * q + m float32 holds)."""
        rng = np.random.default_rng(12)
        weights = rng.standard_normal((6, 96)).astype(np.float32) * np.float32(3)
        tensor_type, data = encode(weights, type_name)
        container = formats.Container(formats.MODEL_MAGIC)
        container.add("w", tensor_type, weights.shape, data)
        got = reference.dequantize(container.tensors["w"])
        expected = gguf_dequantize(container.tensors["w"].data, gguf_type).reshape(weights.shape).astype(np.float64)
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, expected, rtol=2.0**-23, atol=0)
        representable = got.astype(np.float32).astype(np.float64) == got
        np.testing.assert_array_equal(got[representable], expected[representable])
        assert representable.mean() > 0.5


class RefusalTests:
    def test_linear_attention_layers_are_refused(self, tmp_path):
        """A model with a linear-attention layer (type 2) is refused by name, not run wrongly."""
        with pytest.raises(ValueError, match="layer 1 is linear attention"):
            tiny(tmp_path, "llama", layer_types=[0, 2])

    def test_missing_tensor_is_named(self, tmp_path):
        """A gemma3 file without a q-norm weight is refused, naming the tensor."""
        container = tiny_model_container("gemma3", seed=1)
        del container.tensors["blk.1.attn_q_norm.weight"]
        with pytest.raises(ValueError, match="blk.1.attn_q_norm.weight"):
            write(tmp_path, container)

    def test_token_outside_the_vocabulary(self, tmp_path):
        """A token id past the vocabulary is a ValueError naming it."""
        model = tiny(tmp_path, "qwen2")
        with pytest.raises(ValueError, match="token id 71 is outside"):
            model.forward([1, 71])
