"""Tiny random-weight models in the .mlb format, for tests of every architecture.

`write_tiny_model(path, arch, seed=..., weight_type=..., **shape)` writes a model with exactly
the metadata keys and tensor names docs/formats.md lists for llama, qwen2, gemma3, qwen3 and
smollm3 (layer_rope, rope_freqs.weight), with
weights drawn from a seeded generator and scaled so activations stay near unit size through
the layers (matrices N(0, 1/fan_in), norm weights near 1, small biases). Matrices are stored in
`weight_type`; norms and biases are f32, as the converter writes them. With q4_0, the output
head (or the tied embedding) is q8_0, as `krafla convert --type q4_0` does. q4_1, q5_0 and q5_1
(the types ggml files carry and krafla computes natively) keep every matrix, the head included,
in that type. With q4_K or q5_K the head is q6_K, as in ggml's Q4_K_M / Q5_K_M files; k-quant
models take KQUANT_SHAPES (every matrix input a multiple of 256) unless the shape is given.
"""

import math

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from krafla_twisted.convert import quantize
from krafla_twisted.engine import formats
from tests.support import kquants

ARCHS = ("llama", "qwen2", "gemma3", "qwen3", "smollm3")
WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K")
QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# Blocks as ggml writes them (krafla convert copies these types from a GGUF file as they are), by
# gguf-py's quantizers.
GGML_QUANTIZED = {"q4_1": GGMLQuantizationType.Q4_1, "q5_0": GGMLQuantizationType.Q5_0,
                  "q5_1": GGMLQuantizationType.Q5_1}
KQUANTS = ("q4_K", "q5_K", "q6_K")  # super-blocks of 256 (tests/support/kquants.py encodes them)

# Shapes small enough that a numpy forward pass takes milliseconds, yet with GQA, an odd vocab
# and (gemma3) a head width that differs from dim / n_heads.
DEFAULT_SHAPES = {
    "llama": dict(n_vocab=67, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, max_seq=128),
    "qwen2": dict(n_vocab=71, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, max_seq=128),
    "gemma3": dict(n_vocab=73, dim=64, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=96, max_seq=128),
    "qwen3": dict(n_vocab=79, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, ffn_dim=96, max_seq=128),
    "smollm3": dict(n_vocab=83, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=64, max_seq=128),
}

# The same shapes widened for k-quants, whose matrix inputs are multiples of 256: dim 256, four times
# the head width, a wider ffn (gemma3's and qwen3's q widths still differ from dim).
KQUANT_SHAPES = {
    arch: dict(DEFAULT_SHAPES[arch], dim=256, head_dim=4 * DEFAULT_SHAPES[arch]["head_dim"], ffn_dim=ffn_dim)
    for arch, ffn_dim in (("llama", 512), ("qwen2", 768), ("gemma3", 512), ("qwen3", 512), ("smollm3", 256))
}

# Hyperparameters each architecture's real models use; any can be overridden by keyword.
DEFAULT_HYPERPARAMETERS = {
    "llama": dict(norm_eps=1e-5, rope_theta=10000.0, rope_style="norm", activation="silu", tied_embeddings=0),
    "qwen2": dict(norm_eps=1e-6, rope_theta=1000000.0, rope_style="neox", activation="silu", tied_embeddings=1),
    "gemma3": dict(norm_eps=1e-6, rope_theta=1000000.0, rope_theta_local=10000.0, rope_style="neox",
                   activation="gelu_tanh", tied_embeddings=1, sliding_window=6, sliding_window_pattern=2),
    "qwen3": dict(norm_eps=1e-6, rope_theta=1000000.0, rope_style="neox", activation="silu", tied_embeddings=0),
    # SmolLM3's fourth layer has no RoPE; its tiny model also carries Llama 3.1's rope_freqs.weight
    # (factors 1 .. 8 over the pairs), so every engine test covers that path too.
    "smollm3": dict(norm_eps=1e-6, rope_theta=2000000.0, rope_style="norm", activation="silu", tied_embeddings=1,
                    no_rope_interval=4, rope_freqs="llama3"),
}


# ------------------------------------------------------------------------------------------
# Encoding: the converter's quantizers (ggml's reference rounding), so tiny models hold exactly
# the blocks `krafla convert` would write for the same weights.

def to_bf16(weights):
    """float32 -> raw bf16 bytes, rounding to nearest even (finite inputs)."""
    bits = np.asarray(weights, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).view(np.uint8)


def encode(weights, type_name):
    """float32 weights -> (formats.TensorType, data for Container.add) in `type_name`."""
    tensor_type = formats.TENSOR_TYPES_BY_NAME[type_name]
    weights = np.asarray(weights, dtype=np.float32)
    if type_name in ("f32", "f16"):
        return tensor_type, weights
    if type_name == "bf16":
        return tensor_type, to_bf16(weights)
    if type_name in GGML_QUANTIZED:
        rows = weights.reshape(-1, weights.shape[-1])
        return tensor_type, gguf_quantize(rows, GGML_QUANTIZED[type_name]).reshape(-1)
    if type_name in QUANTIZED:
        return tensor_type, quantize.QUANTIZERS[type_name](weights.reshape(-1, weights.shape[-1])).reshape(-1)
    if type_name in KQUANTS:
        return tensor_type, kquants.encode(weights.reshape(-1, weights.shape[-1]), type_name).reshape(-1)
    if type_name in quantize.QUANTIZERS:  # the low-bit types: `krafla convert --type`'s quantizers
        return tensor_type, quantize.QUANTIZERS[type_name](weights.reshape(-1, weights.shape[-1])).reshape(-1)
    raise ValueError(f"cannot store weights as {type_name}")


# ------------------------------------------------------------------------------------------
# Models

def _check_shape(arch, weight_type, shape):
    for key, value in shape.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"tiny {arch}: {key} must be a positive integer, got {value!r}")
    if shape["n_heads"] % shape["n_kv_heads"]:
        raise ValueError(f"tiny {arch}: n_heads {shape['n_heads']} is not a multiple of n_kv_heads {shape['n_kv_heads']}")
    if shape["head_dim"] % 2:
        raise ValueError(f"tiny {arch}: head_dim {shape['head_dim']} must be even for RoPE")
    block = 256 if weight_type in KQUANTS else 32 if weight_type in QUANTIZED else 1  # weights per block
    inputs = {"dim": shape["dim"], "n_heads*head_dim": shape["n_heads"] * shape["head_dim"], "ffn_dim": shape["ffn_dim"]}
    for key, value in inputs.items():
        if value % block:
            raise ValueError(f"tiny {arch}: {key} = {value} must be a multiple of {block} for {weight_type}")


def tiny_model_container(arch, *, seed, weight_type="f32", **overrides):
    """The formats.Container of a tiny model (see write_tiny_model)."""
    if arch not in ARCHS:
        raise ValueError(f"tiny models are {', '.join(ARCHS)}, not {arch!r}")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type is one of {', '.join(WEIGHT_TYPES)}, not {weight_type!r}")
    shape = dict((KQUANT_SHAPES if weight_type in KQUANTS else DEFAULT_SHAPES)[arch])
    shape.update({k: overrides.pop(k) for k in list(overrides) if k in shape})
    _check_shape(arch, weight_type, shape)
    hyper = dict(DEFAULT_HYPERPARAMETERS[arch])
    hyper.update(overrides)
    default_output = {"q4_0": "q8_0", "q4_K": "q6_K", "q5_K": "q6_K"}.get(weight_type, weight_type)
    output_type = hyper.pop("output_type", default_output)
    pattern = hyper.pop("sliding_window_pattern", 0)
    rng = np.random.default_rng(seed)

    n_vocab, dim, n_layers = shape["n_vocab"], shape["dim"], shape["n_layers"]
    n_heads, n_kv_heads, head_dim, ffn_dim = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape["ffn_dim"]
    sliding_window = hyper.pop("sliding_window", 0)
    # gemma3: layer i is full attention when (i + 1) is a multiple of the pattern, else sliding.
    layer_types = hyper.pop("layer_types", None)
    if layer_types is None:
        layer_types = [0 if not pattern or (i + 1) % pattern == 0 else 1 for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ValueError(f"tiny {arch}: {len(layer_types)} layer_types for {n_layers} layers")
    tied = int(hyper.pop("tied_embeddings"))
    rope_theta = float(hyper.pop("rope_theta"))

    metadata = {
        "arch": arch,
        "name": hyper.pop("name", f"tiny-{arch}-{weight_type}-seed{seed}"),
        "n_vocab": n_vocab, "dim": dim, "n_layers": n_layers,
        "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
        "ffn_dim": ffn_dim, "max_seq": shape["max_seq"],
        "norm_eps": float(hyper.pop("norm_eps")),
        "rope_theta": rope_theta,
        "rope_theta_local": float(hyper.pop("rope_theta_local", rope_theta)),
        "rope_scale": float(hyper.pop("rope_scale", 1.0)),
        "rope_style": hyper.pop("rope_style"),
        "rope_dims": int(hyper.pop("rope_dims", head_dim)),
        "activation": hyper.pop("activation"),
        "tied_embeddings": tied,
        "embedding_scale": float(hyper.pop("embedding_scale", math.sqrt(dim) if arch == "gemma3" else 1.0)),
        "attn_scale": float(hyper.pop("attn_scale", 1.0 / math.sqrt(head_dim))),
        "sliding_window": int(sliding_window),
        "layer_types": [int(t) for t in layer_types],
        "attn_softcap": float(hyper.pop("attn_softcap", 0.0)),
        "final_softcap": float(hyper.pop("final_softcap", 0.0)),
    }
    layer_rope = hyper.pop("layer_rope", None)
    interval = hyper.pop("no_rope_interval", 0)
    if layer_rope is None and interval:
        layer_rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if layer_rope is not None:
        metadata["layer_rope"] = [int(f) for f in layer_rope]
    rope_freqs = hyper.pop("rope_freqs", None)
    if hyper:
        raise ValueError(f"tiny {arch}: unknown settings {sorted(hyper)}")

    container = formats.Container(formats.MODEL_MAGIC, metadata)
    if rope_freqs is not None:
        half = metadata["rope_dims"] // 2
        factors = np.geomspace(1.0, 8.0, half) if isinstance(rope_freqs, str) else rope_freqs
        container.add("rope_freqs.weight", formats.F32, (half,), np.asarray(factors, np.float32))

    def matrix(name, rows, cols, type_name=weight_type):
        weights = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(math.sqrt(cols))
        container.add(name, *_encoded(weights, type_name, (rows, cols)))

    def vector(name, size, center, spread):
        values = (center + spread * rng.standard_normal(size)).astype(np.float32)
        container.add(name, formats.F32, (size,), values)

    # Embedding rows N(0, 1/dim), like any matrix with `dim` inputs: tied logits then have unit
    # spread, and gemma3's embedding_scale (√dim) brings its rows to unit RMS.
    embedding = rng.standard_normal((n_vocab, dim), dtype=np.float32) / np.float32(math.sqrt(dim))
    container.add("token_embd.weight", *_encoded(embedding, output_type if tied else weight_type, (n_vocab, dim)))
    vector("output_norm.weight", dim, 1.0, 0.1)
    if not tied:
        matrix("output.weight", n_vocab, dim, output_type)
    q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    for layer in range(n_layers):
        prefix = f"blk.{layer}."
        vector(prefix + "attn_norm.weight", dim, 1.0, 0.1)
        matrix(prefix + "attn_q.weight", q_rows, dim)
        matrix(prefix + "attn_k.weight", kv_rows, dim)
        matrix(prefix + "attn_v.weight", kv_rows, dim)
        if arch == "qwen2":
            vector(prefix + "attn_q.bias", q_rows, 0.0, 0.1)
            vector(prefix + "attn_k.bias", kv_rows, 0.0, 0.1)
            vector(prefix + "attn_v.bias", kv_rows, 0.0, 0.1)
        if arch in ("gemma3", "qwen3"):
            vector(prefix + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vector(prefix + "attn_k_norm.weight", head_dim, 1.0, 0.1)
        matrix(prefix + "attn_output.weight", dim, q_rows)
        if arch == "gemma3":
            vector(prefix + "post_attention_norm.weight", dim, 1.0, 0.1)
        vector(prefix + "ffn_norm.weight", dim, 1.0, 0.1)
        matrix(prefix + "ffn_gate.weight", ffn_dim, dim)
        matrix(prefix + "ffn_up.weight", ffn_dim, dim)
        matrix(prefix + "ffn_down.weight", dim, ffn_dim)
        if arch == "gemma3":
            vector(prefix + "post_ffw_norm.weight", dim, 1.0, 0.1)
    return container


def _encoded(weights, type_name, shape):
    tensor_type, data = encode(weights, type_name)
    return tensor_type, shape, data


def write_tiny_model(path, arch, *, seed, weight_type="f32", **overrides):
    """Write a tiny random `arch` model (llama, qwen2, gemma3) to `path`; returns its Container.

    Shape keywords (n_vocab, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq)
    default to DEFAULT_SHAPES[arch]. Any metadata key of docs/formats.md can be overridden
    (rope_theta=..., tied_embeddings=0, layer_types=[...], ...), plus `output_type` (the type of
    the output head or tied embedding) and, for gemma3, `sliding_window_pattern` (every Nth
    layer is full attention, the rest sliding; 0 makes all layers full). The same arguments
    always give the same file.
    """
    container = tiny_model_container(arch, seed=seed, weight_type=weight_type, **overrides)
    formats.write(path, container)
    return container


def write_tiny_models(folder, weight_types, *, seed, **overrides):
    """One tiny model of every architecture in ARCHS for each weight type, written into `folder`
    as ARCH-TYPE.mlb; returns {(arch, weight_type): path}."""
    paths = {}
    for arch in ARCHS:
        for weight_type in weight_types:
            paths[arch, weight_type] = folder / f"{arch}-{weight_type}.mlb"
            write_tiny_model(paths[arch, weight_type], arch, seed=seed, weight_type=weight_type, **overrides)
    return paths
