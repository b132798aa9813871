"""bench/moe_model.py's upcycling (what bench/perplexity.py --moe measures llama.cpp and krafla on):
a dense llama GGUF made a Mixtral-style one whose widths are padded to whole 256-value
super-blocks. Pinned against the dense model itself: with unperturbed experts, krafla's mixtral
forward pass over the padded upcycled file (arch_moe.c, the expert layer) gives the logits of its
dense llama forward pass over the original (arch_llama.c); perturbed experts and another router
change them, so the routing matters. Runs no llama.cpp (the bench script itself is run by hand:
bench/README.md)."""


import gguf
import numpy as np
import pytest

from krafla_twisted.convert.gguf import convert_gguf
from krafla_twisted.engine.model import Model
from tests.support.bench import bench_module
from tests.support.gguf_vocab import add_tokenizer

# widths none of which is a multiple of 256, with grouped-query attention (3 query heads per key/value head)
DIM, FFN, N_HEADS, N_KV_HEADS, HEAD_DIM, N_VOCAB, N_LAYERS = 96, 160, 3, 1, 32, 12, 2
PROMPT = [1, 5, 7, 3, 9, 11, 4, 6, 8, 10]


@pytest.fixture(scope="module")
def moe_model():
    """bench/moe_model.py as a module."""
    with bench_module("moe_model") as module:
        yield module


def write_dense(path):
    """A random dense llama GGUF, its matrices Q8_0 (gguf-py's quantizer) as a published file's
    are quantized, weights N(0, 1/fan_in) so activations stay near unit size."""
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(writer)

    def matrix(name, rows, cols):
        values = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name):
        writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(DIM)).astype(np.float32))

    matrix("token_embd.weight", N_VOCAB, DIM)
    for layer in range(N_LAYERS):
        blk = f"blk.{layer}."
        norm(blk + "attn_norm.weight")
        matrix(blk + "attn_q.weight", N_HEADS * HEAD_DIM, DIM)
        matrix(blk + "attn_k.weight", N_KV_HEADS * HEAD_DIM, DIM)
        matrix(blk + "attn_v.weight", N_KV_HEADS * HEAD_DIM, DIM)
        matrix(blk + "attn_output.weight", DIM, N_HEADS * HEAD_DIM)
        norm(blk + "ffn_norm.weight")
        matrix(blk + "ffn_gate.weight", FFN, DIM)
        matrix(blk + "ffn_up.weight", FFN, DIM)
        matrix(blk + "ffn_down.weight", DIM, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_dense(tmp_path_factory.mktemp("upcycle") / "dense-Q8_0.gguf")


def logits(source, folder, type_name=None):
    """krafla's logits of every PROMPT position on the GGUF `source`, converted (its types kept,
    or requantized to `type_name`)."""
    mlb, mlt = convert_gguf(source, folder / (source.stem + ".mlb"), folder / (source.stem + ".mlt"), type_name,
                            progress=False)
    with Model(mlb) as model:
        return model.arch, model.session(batch=4).eval_all(PROMPT)


def centred_cosine(a, b):
    a, b = a - a.mean(axis=-1, keepdims=True), b - b.mean(axis=-1, keepdims=True)
    return (a * b).sum(axis=-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


class UpcycleTests:
    """upcycle_gguf: shapes that llama-quantize does not fall back on, and the dense model's values."""

    def test_every_matrix_is_whole_super_blocks(self, moe_model, dense, tmp_path):
        """Both dimensions of every matrix and expert are multiples of 256; the heads grow by whole
        key/value groups (1 -> 8 key/value heads, 3 -> 24 query heads of 32) and the file says
        llama with 4 experts, 2 per token."""
        out = moe_model.upcycle_gguf(tmp_path / "moe.gguf", dense, n_experts=4, n_experts_used=2)
        reader = gguf.GGUFReader(str(out))
        assert reader.fields["general.architecture"].contents() == "llama"
        assert reader.fields["llama.expert_count"].contents() == 4
        assert reader.fields["llama.expert_used_count"].contents() == 2
        assert reader.fields["llama.attention.head_count"].contents() == 24
        assert reader.fields["llama.attention.head_count_kv"].contents() == 8
        shapes = {t.name: [int(n) for n in reversed(t.shape)] for t in reader.tensors}
        assert shapes["blk.0.ffn_gate_exps.weight"] == [4, 256, 256]
        assert shapes["blk.1.ffn_down_exps.weight"] == [4, 256, 256]
        assert shapes["blk.0.attn_q.weight"] == [768, 256]
        assert shapes["blk.0.attn_k.weight"] == [256, 256]
        assert shapes["token_embd.weight"] == [N_VOCAB, 256]
        for name, shape in shapes.items():
            if len(shape) >= 2 and "ffn_gate_inp" not in name and name != "token_embd.weight":
                assert shape[-1] % 256 == 0 and shape[-2] % 256 == 0, name

    def test_unperturbed_experts_give_the_dense_logits(self, moe_model, dense, tmp_path):
        """With spread 0, krafla's mixtral over the padded file gives the logits of its llama over
        the dense file converted to f16 (the upcycled file's matrices are the same f16 values):
        every position's centred cosine >= 0.99999, the same argmax, and no logit further off than
        1e-4 of the largest."""
        out = moe_model.upcycle_gguf(tmp_path / "moe.gguf", dense, spread=0.0)
        arch, got = logits(out, tmp_path)
        dense_arch, want = logits(dense, tmp_path, "f16")
        assert (arch, dense_arch) == ("mixtral", "llama")
        assert np.isfinite(got).all()
        assert centred_cosine(got, want).min() >= 0.99999
        assert np.array_equal(got.argmax(axis=-1), want.argmax(axis=-1))
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()

    def test_perturbed_experts_make_the_routing_matter(self, moe_model, dense, tmp_path):
        """With spread 0.1 the logits leave the dense ones but stay near them (the model still
        predicts what the dense one does), and another seed (router and perturbations) changes them again."""
        _, want = logits(dense, tmp_path, "f16")
        runs = []
        for seed in (0, 1):
            out = moe_model.upcycle_gguf(tmp_path / f"moe-{seed}.gguf", dense, spread=0.1, seed=seed)
            runs.append(logits(out, tmp_path)[1])
        for got in runs:
            cosine = centred_cosine(got, want)
            assert cosine.max() < 0.9999 and cosine.min() > 0.9
        assert centred_cosine(runs[0], runs[1]).max() < 0.9999

    def test_moe_and_other_architectures_are_refused(self, moe_model, tmp_path):
        """An upcycled file (already experts) is not upcycled again."""
        source = write_dense(tmp_path / "dense.gguf")
        once = moe_model.upcycle_gguf(tmp_path / "moe.gguf", source)
        with pytest.raises(SystemExit, match="not a dense llama GGUF"):
            moe_model.upcycle_gguf(tmp_path / "again.gguf", once)
