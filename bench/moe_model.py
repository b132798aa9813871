"""A random-weight qwen3moe .mlb with Qwen3-30B-A3B's per-layer shapes and fewer layers, for
`krafla bench` (issue 28), or the same model as a GGUF that llama.cpp runs too.

    .venv/bin/python bench/moe_model.py OUT.mlb [--layers 2] [--types q4_K_M|q8_0|mxfp4]
    KRAFLA_LIB=build/avx2/libkrafla.so .venv/bin/krafla bench OUT.mlb -t 2 -p 512 -n 128 -r 3
    .venv/bin/python bench/moe_model.py OUT.gguf --tokenizer-from QWEN.gguf    # what bench/compare.py --moe makes
    .venv/bin/python bench/moe_model.py OUT.gguf --upcycle SMOLLM2.gguf         # what bench/perplexity.py --moe makes

A GGUF is written as llama.cpp's converter writes a Qwen3 MoE model (the `qwen3moe` keys, the
experts stacked in ffn_{gate,up,down}_exps), with the tokenizer and its metadata copied from
another GGUF of the Qwen vocabulary (151936 tokens: Qwen2.5's serves), so that llama-bench loads it;
`krafla convert` then makes krafla's .mlb of the same blocks.

Qwen3-30B-A3B per layer: dim 2048, 32 query heads and 4 KV heads of 128, 128 experts of width 768,
8 chosen per token, vocabulary 151936. The blocks are random bytes with finite, small scales (the
weights' values do not change the speed; the routing spreads tokens over the experts as a trained
router does, roughly evenly). q4_K_M: attention and expert gate/up q4_K, expert down and the
output head q6_K, as llama.cpp's Q4_K_M mostly does; q8_0: every matrix q8_0; mxfp4: the experts
mxfp4 and every other matrix q8_0, as llama.cpp's MXFP4_MOE does. Router and norms f32.

A random model's perplexity is about its vocabulary whatever the kernels compute, so comparing two
programs' perplexity needs one that predicts text: --upcycle makes a dense llama GGUF (SmolLM2)
a Mixtral-style one (architecture llama with experts, as llama.cpp writes Mixtral), f16, every
expert the dense FFN slightly perturbed, under a random router, every width padded with zeros to
whole 256-value super-blocks so llama-quantize gives each matrix the type asked for (upcycle_gguf).
"""

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from krafla_twisted.engine import formats  # noqa: E402

SHAPE = dict(dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=768, n_experts=128, n_experts_used=8,
             n_vocab=151936)
# block elements, block bytes, byte offsets of f16 scales (kept finite and small)
# (mxfp4's scale is an E8M0 exponent byte: 118..121 is 2^-9..2^-6, small as the others)
BLOCKS = {"q8_0": (32, 34, (0,)), "q4_K": (256, 144, (0, 2)), "q6_K": (256, 210, (208,)), "mxfp4": (32, 17, ())}
TYPES = {"q4_K_M": dict(attention="q4_K", gate_up="q4_K", down="q6_K", embedding="q4_K", output="q6_K"),
         "q8_0": dict(attention="q8_0", gate_up="q8_0", down="q8_0", embedding="q8_0", output="q8_0"),
         "mxfp4": dict(attention="q8_0", gate_up="mxfp4", down="mxfp4", embedding="q8_0", output="q8_0")}
# ggml's names of the types (GGUF's tensor types)
GGML_TYPES = {"q8_0": "Q8_0", "q4_K": "Q4_K", "q6_K": "Q6_K", "mxfp4": "MXFP4"}


def random_blocks(rng, type_name, shape):
    """Random bytes of `shape` in `type_name`'s blocks, every scale an f16 in [0.001, 0.01) (an
    mxfp4 exponent 2^-9..2^-6)."""
    elements, block_bytes, scales = BLOCKS[type_name]
    n_blocks = math.prod(shape) // elements
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in scales:
        raw[:, offset:offset + 2] = rng.uniform(0.001, 0.01, n_blocks).astype("<f2").view(np.uint8).reshape(-1, 2)
    if type_name == "mxfp4":
        raw[:, 0] = rng.integers(118, 122, n_blocks, dtype=np.uint8)
    return raw.reshape(-1)


def tensors(layers, types, seed=0):
    """(name, type name, shape, data) of every tensor of the model, in file order: data is the raw
    blocks (uint8) of a quantized matrix or the float32 values of a vector or the router."""
    rng = np.random.default_rng(seed)
    s, t = SHAPE, TYPES[types]
    dim, q_dim, kv_dim, ffn, n = s["dim"], s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"], \
        s["ffn_dim"], s["n_experts"]
    out = []

    def matrix(name, type_name, shape):
        out.append((name, type_name, shape, random_blocks(rng, type_name, shape)))

    def vector(name, size):
        out.append((name, "f32", (size,), (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)))

    matrix("token_embd.weight", t["embedding"], (s["n_vocab"], dim))
    for layer in range(layers):
        blk = f"blk.{layer}."
        vector(blk + "attn_norm.weight", dim)
        matrix(blk + "attn_q.weight", t["attention"], (q_dim, dim))
        matrix(blk + "attn_k.weight", t["attention"], (kv_dim, dim))
        matrix(blk + "attn_v.weight", t["attention"], (kv_dim, dim))
        matrix(blk + "attn_output.weight", t["attention"], (dim, q_dim))
        vector(blk + "attn_q_norm.weight", s["head_dim"])
        vector(blk + "attn_k_norm.weight", s["head_dim"])
        vector(blk + "ffn_norm.weight", dim)
        router = (rng.standard_normal((n, dim)) / math.sqrt(dim)).astype(np.float32)
        out.append((blk + "ffn_gate_inp.weight", "f32", router.shape, router))
        matrix(blk + "ffn_gate_exps.weight", t["gate_up"], (n, ffn, dim))
        matrix(blk + "ffn_up_exps.weight", t["gate_up"], (n, ffn, dim))
        matrix(blk + "ffn_down_exps.weight", t["down"], (n, dim, ffn))
    vector("output_norm.weight", dim)
    matrix("output.weight", t["output"], (s["n_vocab"], dim))
    return out


def write(out, layers, types, seed=0):
    """krafla's .mlb of the model."""
    metadata = {"arch": "qwen3moe", "name": f"random-qwen3moe-30b-a3b-{layers}-layers-{types}", "n_layers": layers,
                "max_seq": 40960, "norm_eps": 1e-6, "rope_theta": 1e6, "rope_style": "neox", "activation": "silu",
                "tied_embeddings": 0, "expert_weights_norm": 1, **SHAPE}
    container = formats.Container(formats.MODEL_MAGIC, metadata)
    for name, type_name, shape, data in tensors(layers, types, seed):
        container.add(name, formats.TENSOR_TYPES_BY_NAME[type_name], shape, data)
    formats.write(out, container)
    return out


def copy_tokenizer(writer, source):
    """The tokenizer.* keys of the GGUF reader `source` into `writer`, but its chat template."""
    import gguf

    for key, field in source.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kind)


def add_tensor(writer, name, type_name, shape, data):
    """One tensor of tensors() (or a caller's like it) into the GGUF writer: float32 values as they
    are, quantized blocks as raw bytes of their ggml type."""
    import gguf

    if type_name == "f32":
        writer.add_tensor(name, data.reshape(shape))
        return
    elements, block_bytes, _ = BLOCKS[type_name]
    byte_shape = (*shape[:-1], shape[-1] // elements * block_bytes)
    writer.add_tensor(name, data.reshape(byte_shape), raw_shape=byte_shape,
                      raw_dtype=gguf.GGMLQuantizationType[GGML_TYPES[type_name]])


def finish(writer):
    """Write the GGUF writer's header, keys and tensors to its file and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(out, layers, types, tokenizer_from, seed=0):
    """The model as llama.cpp's converter writes a qwen3moe GGUF, the tokenizer copied from the
    GGUF `tokenizer_from` (its vocabulary must have SHAPE's n_vocab tokens)."""
    import gguf

    source = gguf.GGUFReader(str(tokenizer_from))
    tokens = source.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != SHAPE["n_vocab"]:
        raise SystemExit(f"{tokenizer_from}: its vocabulary is not {SHAPE['n_vocab']} tokens")
    s = SHAPE
    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    writer.add_name(f"random-qwen3moe-30b-a3b-{layers}-layers-{types}")
    writer.add_block_count(layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(s["dim"])
    writer.add_feed_forward_length(6144)
    writer.add_expert_feed_forward_length(s["ffn_dim"])
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(s["n_experts"])
    writer.add_expert_used_count(s["n_experts_used"])
    copy_tokenizer(writer, source)
    for name, type_name, shape, data in tensors(layers, types, seed):
        add_tensor(writer, name, type_name, shape, data)
    finish(writer)
    return out


# --- Upcycling: a dense llama GGUF made a mixture of experts that still predicts text

SUPER_BLOCK = 256  # the k-quants' and iq4_xs' row unit: every width of the upcycled model is a multiple
_DENSE_KEYS = {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.key_length", "attention.value_length",
               "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "vocab_size"}
_DENSE_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def round_up(n, unit=SUPER_BLOCK):
    return -(-n // unit) * unit


def padded_heads(n_heads, n_kv_heads, head_dim):
    """(query heads, key/value heads), key/value heads added (each with its group of query heads,
    so every query head keeps its key/value head) until both projections' widths are multiples of
    SUPER_BLOCK."""
    group, kv = n_heads // n_kv_heads, n_kv_heads
    while (kv * head_dim) % SUPER_BLOCK or (kv * group * head_dim) % SUPER_BLOCK:
        kv += 1
    return kv * group, kv


def pad(values, shape):
    """`values` in the leading corner of zeros of `shape`, float32."""
    out = np.zeros(shape, np.float32)
    out[tuple(slice(0, n) for n in values.shape)] = values
    return out


def upcycled_tensors(reader, shape, n_experts, spread, seed):
    """(name, values) of the upcycled model in file order: matrices float16, vectors and the router
    float32. `shape` holds the dense and the padded widths (upcycle_gguf)."""
    from gguf import quants

    rng = np.random.default_rng(seed)
    by_name = {t.name: t for t in reader.tensors}
    s = shape
    norm_scale = math.sqrt(s["dim"] / s["padded_dim"])
    q_rows, kv_rows = s["padded_heads"] * s["head_dim"], s["padded_kv_heads"] * s["head_dim"]

    def values(name):
        tensor = by_name[name]
        return quants.dequantize(tensor.data, tensor.tensor_type).reshape([int(n) for n in reversed(tensor.shape)])

    def matrix(name, rows, cols):
        return name, pad(values(name), (rows, cols)).astype(np.float16)

    def norm(name):  # RMSNorm over the padded width, the zeros included, gives the dense values
        return name, pad(values(name) * norm_scale, (s["padded_dim"],))

    def experts(matrix_values):  # each expert the dense matrix, every weight scaled by 1 + spread * N(0, 1)
        return np.stack([matrix_values * (1 + spread * rng.standard_normal(matrix_values.shape, np.float32))
                         for _ in range(n_experts)]).astype(np.float16)

    dim, ffn = s["padded_dim"], s["padded_ffn_dim"]
    yield matrix("token_embd.weight", s["n_vocab"], dim)
    for layer in range(s["n_layers"]):
        blk = f"blk.{layer}."
        yield norm(blk + "attn_norm.weight")
        yield matrix(blk + "attn_q.weight", q_rows, dim)
        yield matrix(blk + "attn_k.weight", kv_rows, dim)
        yield matrix(blk + "attn_v.weight", kv_rows, dim)
        yield matrix(blk + "attn_output.weight", dim, q_rows)
        yield norm(blk + "ffn_norm.weight")
        router = pad(rng.standard_normal((n_experts, s["dim"]), np.float32) / math.sqrt(s["dim"]), (n_experts, dim))
        yield blk + "ffn_gate_inp.weight", router
        yield blk + "ffn_gate_exps.weight", experts(pad(values(blk + "ffn_gate.weight"), (ffn, dim)))
        yield blk + "ffn_up_exps.weight", experts(pad(values(blk + "ffn_up.weight"), (ffn, dim)))
        yield blk + "ffn_down_exps.weight", experts(pad(values(blk + "ffn_down.weight"), (dim, ffn)))
    yield norm("output_norm.weight")
    if "output.weight" in by_name:
        yield matrix("output.weight", s["n_vocab"], dim)


def upcycle_gguf(out, dense, n_experts=4, n_experts_used=2, spread=0.1, seed=0):
    """A Mixtral-style GGUF (llama with llama.expert_count, as llama.cpp writes Mixtral) from the
    dense llama GGUF `dense`: every layer's FFN becomes `n_experts` experts, each the dense FFN
    (dequantized by gguf-py) with every weight scaled by 1 + spread * N(0, 1), so the experts
    differ and the routing matters, under a random router whose top `n_experts_used` are
    renormalised (llama.cpp's llama MoE and krafla's mixtral both do). Every width is padded with
    zeros to a multiple of SUPER_BLOCK, so that llama-quantize puts each type's own blocks in
    every matrix rather than falling back where rows are not whole super-blocks: the hidden width
    (the norms' weights scaled by sqrt(dim / padded) and their epsilon by dim / padded, so each norm
    gives the dense values), the FFN width, and the heads (whole key/value heads added with their
    query heads, all zeros). Without the perturbation the model computes the dense one's values."""
    import gguf

    reader = gguf.GGUFReader(str(dense))

    def field(key, default=None):
        found = reader.fields.get(key)
        return default if found is None else found.contents()

    if field("general.architecture") != "llama" or field("llama.expert_count"):
        raise SystemExit(f"{dense}: not a dense llama GGUF (architecture {field('general.architecture')!r})")
    unknown = sorted(k for k in reader.fields if k.startswith("llama.") and k[len("llama."):] not in _DENSE_KEYS)
    if unknown:
        raise SystemExit(f"{dense}: keys {', '.join(unknown)} are not upcycled (only {', '.join(sorted(_DENSE_KEYS))})")
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{layer}.{part}.weight" for layer in range(field("llama.block_count")) for part in _DENSE_LAYER}
    extra = sorted(t.name for t in reader.tensors if t.name not in expected)
    if extra:
        raise SystemExit(f"{dense}: tensors {', '.join(extra[:4])} are not upcycled (a dense llama's only)")
    if not 1 <= n_experts_used <= n_experts:
        raise SystemExit(f"{n_experts_used} experts per token is not between 1 and the {n_experts} experts")
    n_heads = field("llama.attention.head_count")
    n_kv_heads = field("llama.attention.head_count_kv", n_heads)
    dim = field("llama.embedding_length")
    head_dim = field("llama.attention.key_length", dim // n_heads)
    q_heads, kv_heads = padded_heads(n_heads, n_kv_heads, head_dim)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    shape = dict(dim=dim, padded_dim=round_up(dim), head_dim=head_dim, padded_heads=q_heads, padded_kv_heads=kv_heads,
                 padded_ffn_dim=round_up(field("llama.feed_forward_length")),
                 n_layers=field("llama.block_count"), n_vocab=int(embedding.shape[1]))
    epsilon = field("llama.attention.layer_norm_rms_epsilon") * dim / shape["padded_dim"]

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"{field('general.name', Path(dense).stem)} upcycled {n_experts}x top-{n_experts_used}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape["n_layers"])
    writer.add_context_length(field("llama.context_length"))
    writer.add_embedding_length(shape["padded_dim"])
    writer.add_feed_forward_length(shape["padded_ffn_dim"])
    writer.add_head_count(q_heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(field("llama.rope.dimension_count", head_dim))
    writer.add_rope_freq_base(field("llama.rope.freq_base", 10000.0))
    writer.add_layer_norm_rms_eps(epsilon)
    writer.add_vocab_size(shape["n_vocab"])
    writer.add_expert_count(n_experts)
    writer.add_expert_used_count(n_experts_used)
    copy_tokenizer(writer, reader)
    for name, values in upcycled_tensors(reader, shape, n_experts, spread, seed):
        writer.add_tensor(name, values)
    finish(writer)
    return out

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="OUT.mlb, or OUT.gguf (then --tokenizer-from)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--types", choices=sorted(TYPES), default="q4_K_M")
    parser.add_argument("--tokenizer-from", type=Path, help="a GGUF of the Qwen vocabulary (a .gguf output's tokenizer)")
    parser.add_argument("--upcycle", type=Path, metavar="DENSE.gguf",
                        help="instead, OUT.gguf the dense llama GGUF made a Mixtral-style mixture of experts")
    parser.add_argument("--experts", type=int, default=4, help="with --upcycle: experts per layer (default 4)")
    parser.add_argument("--experts-used", type=int, default=2, help="with --upcycle: experts per token (default 2)")
    parser.add_argument("--spread", type=float, default=0.1,
                        help="with --upcycle: each expert weight is the dense one times 1 + SPREAD * N(0, 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.upcycle:
        if args.out.suffix != ".gguf":
            parser.error("--upcycle writes a .gguf")
        print(upcycle_gguf(args.out, args.upcycle, args.experts, args.experts_used, args.spread, args.seed))
    elif args.out.suffix == ".gguf":
        if args.tokenizer_from is None:
            parser.error("a .gguf output needs --tokenizer-from")
        print(write_gguf(args.out, args.layers, args.types, args.tokenizer_from, args.seed))
    else:
        print(write(args.out, args.layers, args.types, args.seed))


if __name__ == "__main__":
    main()
