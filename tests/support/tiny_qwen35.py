"""Tiny random Qwen3.5 (arch `qwen35`) models written straight in the .mlb layout, without torch.

`write_tiny_qwen35(path, seed=..., weight_type="f32", **overrides)` writes the metadata keys and
tensor names docs/formats.md lists for qwen35 (the names `krafla convert HF_FOLDER` gives a
Qwen3.5 checkpoint), with weights from a seeded generator at scales that keep activations near
unit size: matrices N(0, 1/fan_in), norm multipliers near 1, ssm_a = -exp(A_log) in (-1, -0.01)
(a mild decay, so the state holds several tokens), dt biases near 0. The default layer pattern is the released
models': three DeltaNet layers, then one full-attention layer. `favoured_ids` (with an untied
head) scales those rows of output.weight so greedy replies are made of those tokens only.
"""

import math

import numpy as np

from krafla_twisted.engine import formats
from tests.support.tiny_models import encode

DEFAULT = dict(n_vocab=89, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, max_seq=256,
               norm_eps=1e-6, rope_theta=10000000.0, rope_dims=4, tied_embeddings=1,
               linear_conv_kernel=4, linear_k_heads=2, linear_v_heads=4, linear_k_head_dim=16,
               linear_v_head_dim=16, layer_types=None, favoured_ids=())


def qwen35_container(*, seed, weight_type="f32", **overrides):
    """The formats.Container of a random tiny qwen35 model."""
    unknown = set(overrides) - set(DEFAULT)
    if unknown:
        raise TypeError(f"unknown qwen35 settings: {sorted(unknown)}")
    p = dict(DEFAULT, **overrides)
    if p["layer_types"] is None:
        p["layer_types"] = [0 if (i + 1) % 4 == 0 else 2 for i in range(p["n_layers"])]
    rng = np.random.default_rng(seed)
    dim, hd = p["dim"], p["head_dim"]
    key_dim = p["linear_k_heads"] * p["linear_k_head_dim"]
    value_dim = p["linear_v_heads"] * p["linear_v_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    metadata = {
        "arch": "qwen35", "name": "tiny-qwen35", "n_vocab": p["n_vocab"], "dim": dim, "n_layers": p["n_layers"],
        "n_heads": p["n_heads"], "n_kv_heads": p["n_kv_heads"], "head_dim": hd, "ffn_dim": p["ffn_dim"],
        "max_seq": p["max_seq"], "norm_eps": p["norm_eps"], "rope_theta": p["rope_theta"],
        "rope_theta_local": p["rope_theta"], "rope_scale": 1.0, "rope_style": "neox", "rope_dims": p["rope_dims"],
        "activation": "silu", "tied_embeddings": p["tied_embeddings"], "embedding_scale": 1.0,
        "attn_scale": hd ** -0.5, "sliding_window": 0, "layer_types": list(p["layer_types"]),
        "attn_softcap": 0.0, "final_softcap": 0.0,
        "linear_conv_kernel": p["linear_conv_kernel"], "linear_k_heads": p["linear_k_heads"],
        "linear_v_heads": p["linear_v_heads"], "linear_k_head_dim": p["linear_k_head_dim"],
        "linear_v_head_dim": p["linear_v_head_dim"],
    }
    container = formats.Container(formats.MODEL_MAGIC, metadata)

    def matrix(name, rows, cols, type_name=weight_type):
        weights = rng.standard_normal((rows, cols)).astype(np.float32) / np.float32(math.sqrt(cols))
        if name == "output.weight" and p["favoured_ids"]:
            weights[list(p["favoured_ids"])] *= 8  # these tokens win the argmax nearly always
        tensor_type, data = encode(weights, type_name)
        container.add(name, tensor_type, (rows, cols), data)

    def vector(name, values):
        values = np.asarray(values, np.float32)
        container.add(name, formats.F32, values.shape, values)

    head_type = "q8_0" if weight_type == "q4_0" else weight_type
    matrix("token_embd.weight", p["n_vocab"], dim, head_type)
    for i, kind in enumerate(metadata["layer_types"]):
        b = f"blk.{i}."
        vector(b + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(dim))
        if kind == 2:
            matrix(b + "attn_qkv.weight", conv_dim, dim)
            matrix(b + "attn_gate.weight", value_dim, dim)
            matrix(b + "ssm_beta.weight", p["linear_v_heads"], dim)
            matrix(b + "ssm_alpha.weight", p["linear_v_heads"], dim)
            vector(b + "ssm_conv1d.weight", rng.standard_normal((conv_dim, p["linear_conv_kernel"])) * 0.5)
            vector(b + "ssm_dt.bias", 0.5 * rng.standard_normal(p["linear_v_heads"]))
            vector(b + "ssm_a", -rng.uniform(0.01, 1.0, p["linear_v_heads"]))
            vector(b + "ssm_norm.weight", 1 + 0.1 * rng.standard_normal(p["linear_v_head_dim"]))
            matrix(b + "ssm_out.weight", dim, value_dim)
        else:
            matrix(b + "attn_q.weight", 2 * p["n_heads"] * hd, dim)
            matrix(b + "attn_k.weight", p["n_kv_heads"] * hd, dim)
            matrix(b + "attn_v.weight", p["n_kv_heads"] * hd, dim)
            vector(b + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(hd))
            vector(b + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(hd))
            matrix(b + "attn_output.weight", dim, p["n_heads"] * hd)
        vector(b + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(dim))
        matrix(b + "ffn_gate.weight", p["ffn_dim"], dim)
        matrix(b + "ffn_up.weight", p["ffn_dim"], dim)
        matrix(b + "ffn_down.weight", dim, p["ffn_dim"])
    vector("output_norm.weight", 1 + 0.1 * rng.standard_normal(dim))
    if not p["tied_embeddings"]:
        matrix("output.weight", p["n_vocab"], dim, head_type)
    return container


def write_tiny_qwen35(path, *, seed, weight_type="f32", **overrides):
    """Write a random tiny qwen35 .mlb to `path`; returns the path."""
    formats.write(path, qwen35_container(seed=seed, weight_type=weight_type, **overrides))
    return path
