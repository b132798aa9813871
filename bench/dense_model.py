"""A random-weight dense GGUF with the shapes of a model users run on CPUs (Qwen2.5-7B), for
`bench/compare.py --dense` (issue 29: figures at the size people download, where no such file is
published as a package).

    .venv/bin/python bench/dense_model.py OUT.gguf --like QWEN2.5-1.5B-Q4_K_M.gguf [--shape qwen2.5-7b]
    .venv/bin/krafla convert OUT.gguf -o OUT.mlb && .venv/bin/krafla bench OUT.mlb -t 1 -r 3

The file is written as llama.cpp's converter writes the architecture (qwen2: biases on the query,
key and value projections, an output head of its own). Every tensor takes the block type the same
tensor has in the template GGUF `--like`, a published Q4_K_M file of the same family and layer
count (Qwen2.5-Coder-1.5B-Instruct Q4_K_M has Qwen2.5-7B's 28 layers): q4_K for most matrices, q6_K
for the output head and for attn_v and ffn_down in half the layers (14 of 28), as that publisher's
Q4_K_M recipe chose them. The file comes out at 4.68 GB, the size of the Qwen2.5-7B-Instruct Q4_K_M
files people download. The tokenizer is the template's too; its 151936 tokens are the embedding's
rows (Qwen2.5-7B pads its embedding to 152064: 0.1% of the bytes). The blocks are random bytes with
small finite scales (bench/moe_model.py's): the weights' values do not change the speed.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_model import GGML_TYPES, add_tensor, copy_tokenizer, finish, random_blocks  # noqa: E402

# Hugging Face config.json figures of each shape, and the known model (krafla pull's name) whose
# published Q4_K_M GGUF is the template (bench/compare.py --dense)
SHAPES = {
    "qwen2.5-7b": dict(arch="qwen2", n_layers=28, dim=3584, n_heads=28, n_kv_heads=4, head_dim=128, ffn_dim=18944,
                       context=32768, rope_theta=1e6, norm_eps=1e-6, like="qwen2.5-coder-1.5b"),
}


def template_types(like, shape):
    """(a GGUF reader of `like`, {tensor name: block type name} of its tensors); `like` must have the
    shape's architecture and layer count."""
    import gguf

    reader = gguf.GGUFReader(str(like))
    arch = reader.fields["general.architecture"].contents()
    layers = reader.fields[f"{arch}.block_count"].contents()
    if arch != shape["arch"] or layers != shape["n_layers"]:
        raise SystemExit(f"{like}: a {arch} of {layers} layers, not a {shape['arch']} of {shape['n_layers']}")
    names = {v: k for k, v in GGML_TYPES.items()}
    types = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind != "F32" and kind not in names:
            raise SystemExit(f"{like}: {tensor.name} is {kind}, not one of F32, {', '.join(names)}")
        types[tensor.name] = "f32" if kind == "F32" else names[kind]
    return reader, types


def tensors(shape, types, n_vocab, seed=0):
    """(name, type name, shape, data) of every tensor in file order: the raw blocks (uint8) of a
    quantized matrix, the float32 values of a vector."""
    rng = np.random.default_rng(seed)
    s = shape
    dim, q_dim, kv_dim, ffn = s["dim"], s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"], s["ffn_dim"]

    def tensor(name, rows, cols=None):
        kind = types[name]
        if kind == "f32":
            return name, kind, (rows,), (1 + 0.1 * rng.standard_normal(rows)).astype(np.float32)
        return name, kind, (rows, cols), random_blocks(rng, kind, (rows, cols))

    yield tensor("token_embd.weight", n_vocab, dim)
    for layer in range(s["n_layers"]):
        blk = f"blk.{layer}."
        yield tensor(blk + "attn_norm.weight", dim)
        yield tensor(blk + "attn_q.weight", q_dim, dim)
        yield tensor(blk + "attn_q.bias", q_dim)
        yield tensor(blk + "attn_k.weight", kv_dim, dim)
        yield tensor(blk + "attn_k.bias", kv_dim)
        yield tensor(blk + "attn_v.weight", kv_dim, dim)
        yield tensor(blk + "attn_v.bias", kv_dim)
        yield tensor(blk + "attn_output.weight", dim, q_dim)
        yield tensor(blk + "ffn_norm.weight", dim)
        yield tensor(blk + "ffn_gate.weight", ffn, dim)
        yield tensor(blk + "ffn_up.weight", ffn, dim)
        yield tensor(blk + "ffn_down.weight", dim, ffn)
    yield tensor("output_norm.weight", dim)
    yield tensor("output.weight", n_vocab, dim)


def write_gguf(out, like, shape_name="qwen2.5-7b", seed=0):
    """The model of shape `shape_name` as a GGUF at `out`, its tensors' types and its tokenizer
    those of the GGUF `like` (template_types)."""
    import gguf

    s = SHAPES[shape_name]
    reader, types = template_types(like, s)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(out), s["arch"])
    writer.add_name(f"random {shape_name} ({Path(like).name}'s types)")
    writer.add_file_type(reader.fields["general.file_type"].contents())
    writer.add_block_count(s["n_layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["dim"])
    writer.add_feed_forward_length(s["ffn_dim"])
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(s["norm_eps"])
    copy_tokenizer(writer, reader)
    for name, kind, shape, data in tensors(s, types, n_vocab, seed):
        add_tensor(writer, name, kind, shape, data)
    finish(writer)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="OUT.gguf")
    parser.add_argument("--like", type=Path, required=True,
                        help="the published GGUF whose tensor types and tokenizer the model takes")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_gguf(args.out, args.like, args.shape, args.seed))


if __name__ == "__main__":
    main()
