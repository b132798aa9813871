"""A random-weight qwen3moe .mlb with Qwen3-30B-A3B's per-layer shapes and fewer layers, for
`krafla bench` (issue 28).

    .venv/bin/python bench/moe_model.py OUT.mlb [--layers 2] [--types q4_K_M|q8_0]
    KRAFLA_LIB=build/avx2/libkrafla.so .venv/bin/krafla bench OUT.mlb -t 2 -p 512 -n 128 -r 3

Qwen3-30B-A3B per layer: dim 2048, 32 query heads and 4 KV heads of 128, 128 experts of width 768,
8 chosen per token, vocabulary 151936. The blocks are random bytes with finite, small scales (the
weights' values do not change the speed; the routing spreads tokens over the experts as a trained
router does, roughly evenly). q4_K_M: attention and expert gate/up q4_K, expert down and the
output head q6_K, as llama.cpp's Q4_K_M mostly does; q8_0: every matrix q8_0. Router and norms f32.
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
BLOCKS = {"q8_0": (32, 34, (0,)), "q4_K": (256, 144, (0, 2)), "q6_K": (256, 210, (208,))}
TYPES = {"q4_K_M": dict(attention="q4_K", gate_up="q4_K", down="q6_K", embedding="q4_K", output="q6_K"),
         "q8_0": dict(attention="q8_0", gate_up="q8_0", down="q8_0", embedding="q8_0", output="q8_0")}


def random_blocks(rng, type_name, shape):
    """Random bytes of `shape` in `type_name`'s blocks, every scale an f16 in [0.001, 0.01)."""
    elements, block_bytes, scales = BLOCKS[type_name]
    n_blocks = math.prod(shape) // elements
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in scales:
        raw[:, offset:offset + 2] = rng.uniform(0.001, 0.01, n_blocks).astype("<f2").view(np.uint8).reshape(-1, 2)
    return formats.TENSOR_TYPES_BY_NAME[type_name], raw.reshape(-1)


def write(out, layers, types, seed=0):
    rng = np.random.default_rng(seed)
    s, t = SHAPE, TYPES[types]
    dim, q_dim, kv_dim, ffn, n = s["dim"], s["n_heads"] * s["head_dim"], s["n_kv_heads"] * s["head_dim"], \
        s["ffn_dim"], s["n_experts"]
    metadata = {"arch": "qwen3moe", "name": f"random-qwen3moe-30b-a3b-{layers}-layers-{types}", "n_layers": layers,
                "max_seq": 40960, "norm_eps": 1e-6, "rope_theta": 1e6, "rope_style": "neox", "activation": "silu",
                "tied_embeddings": 0, "expert_weights_norm": 1, **s}
    container = formats.Container(formats.MODEL_MAGIC, metadata)

    def matrix(name, type_name, shape):
        tensor_type, raw = random_blocks(rng, type_name, shape)
        container.add(name, tensor_type, shape, raw)

    def vector(name, size):
        container.add(name, formats.F32, (size,), (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

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
        container.add(blk + "ffn_gate_inp.weight", formats.F32, router.shape, router)
        matrix(blk + "ffn_gate_exps.weight", t["gate_up"], (n, ffn, dim))
        matrix(blk + "ffn_up_exps.weight", t["gate_up"], (n, ffn, dim))
        matrix(blk + "ffn_down_exps.weight", t["down"], (n, dim, ffn))
    vector("output_norm.weight", dim)
    matrix("output.weight", t["output"], (s["n_vocab"], dim))
    formats.write(out, container)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--types", choices=sorted(TYPES), default="q4_K_M")
    args = parser.parse_args(argv)
    print(write(args.out, args.layers, args.types))


if __name__ == "__main__":
    main()
