"""bench/dense_model.py (what bench/compare.py --dense measures llama.cpp and krafla on): a random
dense GGUF with a larger model's shapes whose every tensor takes the block type it has in a template
GGUF of the same architecture and layer count. Pinned on a small shape: the types and shapes in the
file gguf-py reads back, and krafla converting and running it. Runs no llama.cpp (the bench itself
is run by hand: bench/README.md)."""


import gguf
import numpy as np
import pytest

from krafla_twisted.convert.gguf import convert_gguf
from krafla_twisted.engine.model import Model
from tests.support.bench import bench_module
from tests.support.gguf_vocab import TOKENS, add_tokenizer

SMALL = dict(arch="qwen2", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, context=128,
             rope_theta=1e6, norm_eps=1e-6, like="-")
# the template's types: q6_K where a published Q4_K_M has it in some layers, q4_K elsewhere
TEMPLATE_TYPES = {"token_embd.weight": "q4_K", "output.weight": "q6_K", "blk.0.attn_v.weight": "q6_K",
                  "blk.1.ffn_down.weight": "q6_K"}


@pytest.fixture(scope="module")
def bench_modules():
    """(bench/moe_model.py, bench/dense_model.py) as modules."""
    with bench_module("moe_model") as moe_model, bench_module("dense_model") as dense_model:
        yield moe_model, dense_model


def write_template(path, moe_model, n_layers=2):
    """A qwen2 GGUF of another width than SMALL's but its layer count, of TEMPLATE_TYPES' types."""
    rng = np.random.default_rng(3)
    dim, ffn, q_dim, kv_dim = 512, 1024, 512, 256
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(n_layers)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_tokenizer(writer)

    def matrix(name, rows, cols):
        kind = TEMPLATE_TYPES.get(name, "q4_K")
        moe_model.add_tensor(writer, name, kind, (rows, cols), moe_model.random_blocks(rng, kind, (rows, cols)))

    def vector(name, size):
        writer.add_tensor(name, np.ones(size, np.float32))

    matrix("token_embd.weight", len(TOKENS), dim)
    for layer in range(n_layers):
        blk = f"blk.{layer}."
        vector(blk + "attn_norm.weight", dim)
        for part, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            matrix(blk + part + ".weight", rows, dim)
            vector(blk + part + ".bias", rows)
        matrix(blk + "attn_output.weight", dim, q_dim)
        vector(blk + "ffn_norm.weight", dim)
        matrix(blk + "ffn_gate.weight", ffn, dim)
        matrix(blk + "ffn_up.weight", ffn, dim)
        matrix(blk + "ffn_down.weight", dim, ffn)
    vector("output_norm.weight", dim)
    matrix("output.weight", len(TOKENS), dim)
    moe_model.finish(writer)
    return path


@pytest.fixture(scope="module")
def written(bench_modules, tmp_path_factory):
    """(the template, the small dense model written after it)."""
    moe_model, dense_model = bench_modules
    folder = tmp_path_factory.mktemp("dense")
    template = write_template(folder / "template.gguf", moe_model)
    dense_model.SHAPES["small"] = SMALL
    try:
        return template, dense_model.write_gguf(folder / "small.gguf", template, "small")
    finally:
        del dense_model.SHAPES["small"]


class DenseModelTests:
    def test_every_tensor_has_the_templates_type_and_the_shapes_width(self, written):
        template, out = written
        expected = {t.name: t.tensor_type for t in gguf.GGUFReader(str(template)).tensors}
        got = gguf.GGUFReader(str(out))
        assert [t.name for t in got.tensors] == list(expected)
        for tensor in got.tensors:
            assert tensor.tensor_type == expected[tensor.name], tensor.name
        shapes = {t.name: [int(n) for n in reversed(t.shape)] for t in got.tensors}
        q_dim, kv_dim = SMALL["n_heads"] * SMALL["head_dim"], SMALL["n_kv_heads"] * SMALL["head_dim"]
        assert shapes["token_embd.weight"] == [len(TOKENS), SMALL["dim"]]
        assert shapes["blk.1.attn_q.weight"] == [q_dim, SMALL["dim"]]
        assert shapes["blk.1.attn_k.bias"] == [kv_dim]
        assert shapes["blk.0.ffn_down.weight"] == [SMALL["dim"], SMALL["ffn_dim"]]
        assert shapes["output.weight"] == [len(TOKENS), SMALL["dim"]]
        assert [bytes(got.fields["tokenizer.ggml.tokens"].parts[i]).decode()
                for i in got.fields["tokenizer.ggml.tokens"].data] == TOKENS

    def test_krafla_converts_and_runs_it(self, written, tmp_path):
        _template, out = written
        mlb, _mlt = convert_gguf(out, tmp_path / "small.mlb", tmp_path / "small.mlt", None, progress=False)
        with Model(mlb) as model:
            assert model.arch == "qwen2"
            logits = model.session(batch=4).eval_all([1, 4, 5, 6, 7])
        assert logits.shape == (5, len(TOKENS))
        assert np.isfinite(logits).all() and np.ptp(logits) > 0

    def test_a_template_of_another_layer_count_is_refused(self, bench_modules, tmp_path):
        moe_model, dense_model = bench_modules
        template = write_template(tmp_path / "three.gguf", moe_model, n_layers=3)
        dense_model.SHAPES["small"] = SMALL
        try:
            with pytest.raises(SystemExit, match="a qwen2 of 3 layers, not a qwen2 of 2"):
                dense_model.write_gguf(tmp_path / "small.gguf", template, "small")
        finally:
            del dense_model.SHAPES["small"]
