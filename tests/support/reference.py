"""An independent numpy forward pass over a .mlb file: the truth the C engine is tested against.

Written from the architectures' definitions (the Llama, Qwen2 and Gemma 3 papers and the Hugging
Face modeling code, read, not copied), sharing nothing with engine_c but the container reader
(krafla_twisted.engine.formats). tests/reference/test_transformers.py checks it against Hugging Face
transformers on the three real models.

Precision: weights are dequantized exactly into float32 (every f16/bf16/q8_0/q4_0 weight is a
float32 number; q4_1, q5_0 and q5_1 weights, d * q + m, into float64: f16 values are multiples of
2^-24 below 2^16, so d * q + m takes at most 46 bits; k-quants into float32 as ggml computes
them), and everything is computed in float64: the residual stream, norms, RoPE, attention,
softmax, and the matrix products (each weight matrix is widened to float64 in row chunks as it is
used, so memory stays at one float32 copy of the model). Logits come back as float32.

Conventions (the facts docs/formats.md states, which this file implements):
- RMSNorm: x / sqrt(mean(x^2) + norm_eps) * w, with w the final multiplier (gemma's 1 + w is
  already added by the converter).
- RoPE rotates the first rope_dims dimensions of each q/k head by angle
  (position / scale) * theta^(-2i / rope_dims) for pair i; `norm` pairs are (x[2i], x[2i+1]),
  `neox` pairs are (x[i], x[i + rope_dims/2]). Full-attention layers use rope_theta and
  rope_scale; sliding-window layers use rope_theta_local and no scaling.
- GQA: query head h reads key/value head h // (n_heads / n_kv_heads).
- Sliding window: a query at position p sees keys at positions p - sliding_window + 1 .. p
  (the token itself and the sliding_window - 1 before it), as transformers and llama.cpp do.
- Scores are q.k * attn_scale, then soft-capped (cap * tanh(s / cap)) when attn_softcap > 0;
  logits likewise with final_softcap.
- gemma3: q and k are RMS-normed per head before RoPE; the attention and MLP outputs are
  RMS-normed (post_attention_norm, post_ffw_norm) before their residual adds.
- qwen3: q and k are RMS-normed per head before RoPE (w itself, no 1 + w); no biases.
- mistral, phi3 (q/k/v and gate/up split by the converter) and smollm3 are llama's block.
- rope_freqs.weight (Llama 3.1's scaling), when present: pair i's frequency is divided by
  rope_freqs[i], in every layer.
- layer_rope (smollm3), when present: a layer whose flag is 0 does not rotate q and k at all.
"""

import math

import numpy as np

from krafla_twisted.convert import quantize
from krafla_twisted.engine import formats
from tests.support import kquants

ROPE_STYLES = ("norm", "neox")
ACTIVATIONS = ("silu", "gelu_tanh")
FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION = 0, 1, 2
ROW_CHUNK = 8192  # weight rows widened to float64 at a time
# The weight types whose matmuls take activations rounded to q8_0 blocks (ggml's q8_1 for q4_1 and
# q5_1 has the same quants and scale; krafla keeps the sum exact instead of ggml's f16 d * sum).
Q8_ACTIVATION_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
ARCHS = ("llama", "qwen2", "gemma3", "qwen3", "mistral", "phi3", "smollm3")


# ------------------------------------------------------------------------------------------
# Dequantization of the .mlb tensor types (docs/formats.md), to float32, exact.

def dequantize(tensor):
    """A formats.Tensor -> float32 array of its shape."""
    raw = tensor.data
    name = tensor.type.name
    if name == "f32":
        values = raw.view("<f4")
    elif name == "f16":
        values = raw.view("<f2").astype(np.float32)
    elif name == "bf16":
        values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif name == "q8_0":
        blocks = raw.reshape(-1, 34)
        scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # (n_blocks, 1)
        values = blocks[:, 2:].view(np.int8).astype(np.float32) * scale
    elif name == "q4_0":
        blocks = raw.reshape(-1, 18)
        scale = blocks[:, :2].copy().view("<f2").astype(np.float32)
        packed = blocks[:, 2:]
        nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
        values = (nibbles - 8) * scale
    elif name in ("q4_1", "q5_0", "q5_1"):
        values = dequantize_ggml_32(name, raw)
    elif name in kquants.BLOCK_BYTES:  # ggml's arithmetic, in float32 (test_reference_tiny checks it against gguf-py)
        values = kquants.dequantize(raw, name)
    else:
        raise ValueError(f"tensor {tensor.name}: the reference cannot dequantize type {name}")
    return values.reshape(tensor.shape)


def dequantize_ggml_32(name, raw):
    """q4_1, q5_0, q5_1 bytes (ggml's layouts: f16 d, [f16 m], [u32 fifth bits, bit j for weight j],
    16 bytes of nibbles, byte j holding weight j low and j + 16 high) -> their exact values."""
    block_bytes = {"q4_1": 20, "q5_0": 22, "q5_1": 24}[name]
    blocks = raw.reshape(-1, block_bytes)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float64)
    with_min, with_fifth = name != "q5_0", name != "q4_1"
    minimum = blocks[:, 2:4].copy().view("<f2").astype(np.float64) if with_min else 0.0
    packed = blocks[:, block_bytes - 16:]
    quants = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int64)
    if with_fifth:
        fifth = blocks[:, block_bytes - 20:block_bytes - 16].copy().view("<u4").astype(np.int64)  # (n_blocks, 1)
        quants |= ((fifth >> np.arange(32)) & 1) << 4
    if name == "q5_0":
        return (quants - 16) * scale
    return quants * scale + minimum


# ------------------------------------------------------------------------------------------
# The pieces of a block, each on float64 arrays with the sequence as the first axis.

def rms_norm(x, weight, eps):
    """Normalize the last axis of x to unit RMS, then scale by weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def linear(x, weight, bias=None):
    """x (n, inputs) float64 @ weight (outputs, inputs).T -> (n, outputs) float64."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float64)
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = weight[start:start + ROW_CHUNK].astype(np.float64)
        out[:, start:start + len(rows)] = x @ rows.T
    if bias is not None:
        out += bias
    return out


def rope(x, positions, theta, scale, style, rope_dims, divisors=None):
    """Rotate x (n, heads, head_dim) at `positions` (n,); dimensions past rope_dims stay.
    `divisors` (rope_dims / 2,): each pair's frequency is divided by its entry."""
    half = rope_dims // 2
    inverse_frequency = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rope_dims)
    if divisors is not None:
        inverse_frequency = inverse_frequency / np.asarray(divisors, dtype=np.float64)
    angle = (np.asarray(positions, dtype=np.float64) / scale)[:, None] * inverse_frequency  # (n, half)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.copy()
    if style == "norm":
        first, second = x[..., 0:rope_dims:2], x[..., 1:rope_dims:2]
        out[..., 0:rope_dims:2] = first * cos - second * sin
        out[..., 1:rope_dims:2] = first * sin + second * cos
    elif style == "neox":
        first, second = x[..., :half], x[..., half:rope_dims]
        out[..., :half] = first * cos - second * sin
        out[..., half:rope_dims] = first * sin + second * cos
    else:
        raise ValueError(f"unknown rope_style {style!r}")
    return out


def softcap(x, cap):
    return cap * np.tanh(x / cap) if cap > 0 else x


def activation(name, gate):
    if name == "silu":
        return gate / (1.0 + np.exp(-gate))
    if name == "gelu_tanh":
        return 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate ** 3)))
    raise ValueError(f"unknown activation {name!r}")


def attention(q, k, v, query_positions, key_positions, scale, window, cap):
    """Causal (optionally sliding-window) attention with GQA.

    q (n, n_heads, head_dim), k and v (m, n_kv_heads, head_dim) -> (n, n_heads * head_dim).
    A query at position p sees the keys at positions p - window < position <= p (window 0: all
    positions <= p).
    """
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    group = n_heads // n_kv_heads
    # Query head h reads key/value head h // group: repeat each kv head `group` times in order.
    k = np.repeat(k, group, axis=1).transpose(1, 0, 2)  # (n_heads, m, head_dim)
    v = np.repeat(v, group, axis=1).transpose(1, 0, 2)
    scores = softcap(q.transpose(1, 0, 2) @ k.transpose(0, 2, 1) * scale, cap)  # (n_heads, n, m)
    distance = np.asarray(query_positions)[:, None] - np.asarray(key_positions)[None, :]
    visible = distance >= 0
    if window:
        visible &= distance < window
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out = weights @ v  # (n_heads, n, head_dim)
    return out.transpose(1, 0, 2).reshape(q.shape[0], -1)


# ------------------------------------------------------------------------------------------
# The model

class Config:
    """The hyperparameters of a .mlb, from its metadata (docs/formats.md)."""

    REQUIRED = ("arch", "n_vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "norm_eps", "rope_theta", "rope_style", "activation")

    def __init__(self, metadata, path):
        missing = [key for key in self.REQUIRED if key not in metadata]
        if missing:
            raise ValueError(f"{path}: metadata lacks {', '.join(missing)}")
        self.arch = metadata["arch"]
        if self.arch not in ARCHS:
            raise ValueError(f"{path}: the reference implements {', '.join(ARCHS)}, not {self.arch!r}")
        for key in ("n_vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"):
            setattr(self, key, int(metadata[key]))
        self.norm_eps = float(metadata["norm_eps"])
        self.rope_theta = float(metadata["rope_theta"])
        self.rope_theta_local = float(metadata.get("rope_theta_local", self.rope_theta))
        self.rope_scale = float(metadata.get("rope_scale", 1.0))
        self.rope_style = metadata["rope_style"]
        self.rope_dims = int(metadata.get("rope_dims", self.head_dim))
        self.activation = metadata["activation"]
        self.tied_embeddings = bool(metadata.get("tied_embeddings", 0))
        self.embedding_scale = float(metadata.get("embedding_scale", 1.0))
        self.attn_scale = float(metadata.get("attn_scale", 1.0 / math.sqrt(self.head_dim)))
        self.sliding_window = int(metadata.get("sliding_window", 0))
        self.layer_types = [int(t) for t in metadata.get("layer_types", [FULL_ATTENTION] * self.n_layers)]
        self.attn_softcap = float(metadata.get("attn_softcap", 0.0))
        self.final_softcap = float(metadata.get("final_softcap", 0.0))
        self.layer_rope = [int(f) for f in metadata.get("layer_rope", [1] * self.n_layers)]
        self._check(path)

    def _check(self, path):
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"{path}: rope_style {self.rope_style!r}, expected one of {ROPE_STYLES}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{path}: activation {self.activation!r}, expected one of {ACTIVATIONS}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{path}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim:
            raise ValueError(f"{path}: rope_dims {self.rope_dims} must be even and at most head_dim {self.head_dim}")
        if len(self.layer_rope) != self.n_layers or any(f not in (0, 1) for f in self.layer_rope):
            raise ValueError(f"{path}: layer_rope {self.layer_rope} is not one 0/1 flag per layer")
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"{path}: {len(self.layer_types)} layer_types for {self.n_layers} layers")
        for layer, kind in enumerate(self.layer_types):
            if kind == LINEAR_ATTENTION:
                raise ValueError(f"{path}: layer {layer} is linear attention, which the reference does not implement")
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(f"{path}: layer {layer} has unknown type {kind}")
            if kind == SLIDING_ATTENTION and self.sliding_window < 1:
                raise ValueError(f"{path}: layer {layer} is sliding-window but sliding_window is {self.sliding_window}")


class Cache:
    """Keys and values (after RoPE) of the positions seen so far, per layer."""

    def __init__(self, n_layers):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers
        self.n_tokens = 0

    def extend(self, layer, keys, values):
        """Append (m, n_kv_heads, head_dim) keys and values; returns all of them."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = keys, values
        else:
            self.keys[layer] = np.concatenate([self.keys[layer], keys])
            self.values[layer] = np.concatenate([self.values[layer], values])
        return self.keys[layer], self.values[layer]


class ReferenceModel:
    """A .mlb model run by numpy: `forward(ids)` -> (n_tokens, n_vocab) float32 logits."""

    def __init__(self, mlb_path, q8_activations=False):
        """`q8_activations`: multiply q8_0/q4_0 weights by activations rounded to q8_0 blocks
        (ggml's quantizer, as the engine and llama.cpp do) instead of exact ones. This is the
        arithmetic the engine defines for quantized weights, so greedy picks can be compared."""
        self.path = str(mlb_path)
        self.q8_activations = q8_activations
        self.container = formats.read(self.path, magic=formats.MODEL_MAGIC)
        self.config = Config(self.container.metadata, self.path)
        self._weights = {}
        self._check_tensors()

    def _check_tensors(self):
        config = self.config
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        expected = {"token_embd.weight": (config.n_vocab, config.dim), "output_norm.weight": (config.dim,)}
        if not config.tied_embeddings:
            expected["output.weight"] = (config.n_vocab, config.dim)
        for layer in range(config.n_layers):
            shapes = {
                "attn_norm.weight": (config.dim,),
                "attn_q.weight": (q_rows, config.dim),
                "attn_k.weight": (kv_rows, config.dim),
                "attn_v.weight": (kv_rows, config.dim),
                "attn_output.weight": (config.dim, q_rows),
                "ffn_norm.weight": (config.dim,),
                "ffn_gate.weight": (config.ffn_dim, config.dim),
                "ffn_up.weight": (config.ffn_dim, config.dim),
                "ffn_down.weight": (config.dim, config.ffn_dim),
            }
            if config.arch == "qwen2":
                shapes.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
            if config.arch == "qwen3":
                shapes.update({"attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,)})
            if config.arch == "gemma3":
                shapes.update({"attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,),
                               "post_attention_norm.weight": (config.dim,), "post_ffw_norm.weight": (config.dim,)})
            expected.update({f"blk.{layer}.{name}": shape for name, shape in shapes.items()})
        if "rope_freqs.weight" in self.container.tensors:
            expected["rope_freqs.weight"] = (config.rope_dims // 2,)
        for name, shape in expected.items():
            tensor = self.container.tensors.get(name)
            if tensor is None:
                raise ValueError(f"{self.path}: {config.arch} needs tensor {name}, which is missing")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{self.path}: tensor {name} has shape {tensor.shape}, expected {shape}")

    @property
    def n_vocab(self):
        return self.config.n_vocab

    def weight(self, name):
        """Tensor `name` as float32 (dequantized once, then kept), or None if absent."""
        if name not in self._weights:
            tensor = self.container.tensors.get(name)
            self._weights[name] = None if tensor is None else dequantize(tensor)
        return self._weights[name]

    def _linear(self, x, name, bias=None):
        """x @ weight `name`.T (+ bias), with x rounded to q8_0 first where q8_activations says."""
        type_name = self.container.tensors[name].type.name
        if self.q8_activations and type_name in kquants.BLOCK_BYTES:  # k-quants: q8_K, ggml's quantizer
            d, q, _ = kquants.quantize_q8_K(x.astype(np.float32))
            x = (d.astype(np.float64)[:, None] * q).reshape(x.shape)
        if self.q8_activations and type_name in Q8_ACTIVATION_TYPES:
            rows = quantize.quantize_q8_0(x.astype(np.float32))
            x = quantize.dequantize("Q8_0", rows, x.shape[1]).reshape(x.shape).astype(np.float64)
        return linear(x, self.weight(name), bias)

    def _layer(self, layer, x, positions, cache):
        """One transformer block on x (n, dim) at `positions`; returns the new x."""
        config = self.config
        w = lambda name: self.weight(f"blk.{layer}.{name}")  # noqa: E731
        lin = lambda x, name, bias=None: self._linear(x, f"blk.{layer}.{name}", bias)  # noqa: E731
        n = x.shape[0]
        sliding = config.layer_types[layer] == SLIDING_ATTENTION

        h = rms_norm(x, w("attn_norm.weight"), config.norm_eps)
        q = lin(h, "attn_q.weight", w("attn_q.bias")).reshape(n, config.n_heads, config.head_dim)
        k = lin(h, "attn_k.weight", w("attn_k.bias")).reshape(n, config.n_kv_heads, config.head_dim)
        v = lin(h, "attn_v.weight", w("attn_v.bias")).reshape(n, config.n_kv_heads, config.head_dim)
        if w("attn_q_norm.weight") is not None:
            q = rms_norm(q, w("attn_q_norm.weight"), config.norm_eps)
        if w("attn_k_norm.weight") is not None:
            k = rms_norm(k, w("attn_k_norm.weight"), config.norm_eps)
        theta, scale = (config.rope_theta_local, 1.0) if sliding else (config.rope_theta, config.rope_scale)
        if config.layer_rope[layer]:
            divisors = self.weight("rope_freqs.weight")
            q = rope(q, positions, theta, scale, config.rope_style, config.rope_dims, divisors)
            k = rope(k, positions, theta, scale, config.rope_style, config.rope_dims, divisors)
        keys, values = cache.extend(layer, k, v)
        out = attention(q, keys, values, positions, np.arange(len(keys)), config.attn_scale,
                        config.sliding_window if sliding else 0, config.attn_softcap)
        out = lin(out, "attn_output.weight")
        if w("post_attention_norm.weight") is not None:
            out = rms_norm(out, w("post_attention_norm.weight"), config.norm_eps)
        x = x + out

        h = rms_norm(x, w("ffn_norm.weight"), config.norm_eps)
        hidden = activation(config.activation, lin(h, "ffn_gate.weight")) * lin(h, "ffn_up.weight")
        out = lin(hidden, "ffn_down.weight")
        if w("post_ffw_norm.weight") is not None:
            out = rms_norm(out, w("post_ffw_norm.weight"), config.norm_eps)
        return x + out

    def _advance(self, cache, token_ids):
        """Run token_ids after the cache's tokens; returns the final-normed hidden states (n, dim)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens to evaluate")
        bad = ids[(ids < 0) | (ids >= self.config.n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary of {self.config.n_vocab}")
        positions = np.arange(cache.n_tokens, cache.n_tokens + ids.size)
        x = self.weight("token_embd.weight")[ids].astype(np.float64) * self.config.embedding_scale
        for layer in range(self.config.n_layers):
            x = self._layer(layer, x, positions, cache)
        cache.n_tokens += ids.size
        return rms_norm(x, self.weight("output_norm.weight"), self.config.norm_eps)

    def _logits(self, hidden):
        head = "token_embd.weight" if self.config.tied_embeddings else "output.weight"
        return softcap(self._linear(hidden, head), self.config.final_softcap)

    def forward(self, token_ids):
        """Logits at every position of token_ids (from an empty context): (n_tokens, n_vocab) float32."""
        hidden = self._advance(Cache(self.config.n_layers), token_ids)
        return self._logits(hidden).astype(np.float32)

    def last_logits(self, token_ids):
        """Logits at the last position only, (n_vocab,) float32; cheaper than forward on long inputs."""
        hidden = self._advance(Cache(self.config.n_layers), token_ids)
        return self._logits(hidden[-1:])[0].astype(np.float32)

    def greedy(self, prompt_ids, n):
        """The n tokens greedy decoding appends to prompt_ids (argmax, lowest id on ties)."""
        cache = Cache(self.config.n_layers)
        hidden = self._advance(cache, prompt_ids)
        generated = []
        for _ in range(n):
            token = int(np.argmax(self._logits(hidden[-1:])[0]))
            generated.append(token)
            if len(generated) < n:
                hidden = self._advance(cache, [token])
        return generated
