"""Quick speed check of the matmul kernels: GFLOP/s and weight GB/s, one thread.

    KRAFLA_LIB=build/avx2/libkrafla.so .venv/bin/python bench/kernels.py [--impl avx2] [--repeat 200] [--packed]

Shapes are the projections of SmolLM2-135M (576x1536) and Qwen2.5-0.5B (896x4864, as rows x cols
4864x896 and 896x4864), for 1 token (generation: should be bound by memory bandwidth) and 32
tokens (prompt processing: bound by arithmetic). Times include preparing the activations (q8_0
quantization), timed in C in thread CPU time: the best of --repeat runs. --packed multiplies the
packable weights (kernels.PACKABLE: q4_0, q8_0, q4_1, q5_0, q5_1, the k-quants, iq4_nl and mxfp4) in
the packed layout the engine uses after loading a model (kernels.h, legacy.h).
k-quants (--types q4_K,q5_K,q6_K) need rows of whole 256-wide super-blocks: they run the shapes of
Qwen2.5-0.5B's down projection (896x4864), Gemma-3-270M's (640x2048) and its up projection (2048x640
has 640 columns, so 2048x1024 stands in for it). The low-bit types (--types q2_K,q3_K,iq4_xs,iq4_nl,mxfp4)
run the same shapes; q2_K, q3_K and iq4_xs always in the file layout (they are not packed).
"""

import argparse
import numpy as np

from krafla_twisted.engine import formats, kernels

SHAPES = [(1536, 576), (576, 1536), (4864, 896), (896, 4864)]  # (rows, cols) of W
KQUANT_SHAPES = [(896, 4864), (640, 2048), (2048, 1024)]
# The low-bit types: where each block keeps its f16 scales (mxfp4: an E8M0 exponent byte at 0)
LOW_BIT_SCALES = {"q2_K": (80, 82), "q3_K": (108,), "iq4_xs": (0,), "iq4_nl": (0,), "mxfp4": ()}


def random_weights(type_name, rows, cols, rng):
    """Random bytes shaped as valid weights: quantized blocks with sane f16 scales."""
    if type_name in kernels.BLOCK_BYTES:
        block_bytes = kernels.BLOCK_BYTES[type_name]
        blocks = rng.integers(0, 256, (rows * cols // 32, block_bytes), dtype=np.uint8)
        blocks[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if type_name in ("q4_1", "q5_1"):  # the minimum
            blocks[:, 2:4] = np.frombuffer(np.float16(-0.08).tobytes(), np.uint8)
        return blocks.reshape(-1)
    if type_name in kernels.KQUANTS:  # random quants and scales; d (and dmin) small f16 values
        blocks = rng.integers(0, 256, (rows * cols // 256, kernels.SUPER_BLOCK_BYTES[type_name]), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        if type_name == "q6_K":
            blocks[:, 208:210] = scale
        else:
            blocks[:, 0:2] = blocks[:, 2:4] = scale
        return blocks.reshape(-1)
    if type_name in LOW_BIT_SCALES:
        tensor_type = formats.TENSOR_TYPES_BY_NAME[type_name]
        blocks = rng.integers(0, 256, (rows * cols // tensor_type.block, tensor_type.block_bytes), dtype=np.uint8)
        for offset in LOW_BIT_SCALES[type_name]:
            blocks[:, offset:offset + 2] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
        if type_name == "mxfp4":
            blocks[:, 0] = 118  # 2^-10
        return blocks.reshape(-1)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if type_name == "f16":
        return values.astype(np.float16).view(np.uint8).reshape(-1)
    return values.view(np.uint8).reshape(-1)


def measure(type_name, rows, cols, n_tokens, impl, repeat, rng, packed):
    weights = random_weights(type_name, rows, cols, rng)
    packed = packed and type_name in kernels.PACKABLE
    if packed:
        weights = kernels.pack(type_name, weights, rows, cols)
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    best = kernels.bench_matmul(type_name, weights, rows, cols, x, impl, repeat, packed)
    gflops = 2 * rows * cols * n_tokens / best / 1e9
    gbytes = weights.size / best / 1e9
    return best, gflops, gbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="dispatch", choices=sorted(kernels.IMPLEMENTATIONS))
    parser.add_argument("--types", default="q4_0,q8_0", help="comma-separated weight types")
    parser.add_argument("--tokens", default="1,32", help="comma-separated token counts")
    parser.add_argument("--repeat", type=int, default=100)
    parser.add_argument("--packed", action="store_true", help="the packable weights in the packed layout")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"library ISA {kernels.isa()}, implementation {args.impl}, {'packed' if args.packed else 'file'} layout, "
          f"best of {args.repeat}")
    print(f"{'type':5} {'rows x cols':>11} {'tokens':>6} {'us':>9} {'GFLOP/s':>8} {'weight GB/s':>11}")
    for type_name in args.types.split(","):
        for rows, cols in KQUANT_SHAPES if type_name in kernels.KQUANTS or type_name in LOW_BIT_SCALES else SHAPES:
            for n_tokens in map(int, args.tokens.split(",")):
                seconds, gflops, gbytes = measure(type_name, rows, cols, n_tokens, args.impl, args.repeat, rng, args.packed)
                print(f"{type_name:5} {rows:>5}x{cols:<5} {n_tokens:>6} {seconds * 1e6:>9.1f} {gflops:>8.1f} {gbytes:>11.1f}")


if __name__ == "__main__":
    main()
