"""GGUF -> krafla: the model as .mlb (weights + hyperparameters), the tokenizer as .mlt.

`convert_gguf(src, out_mlb, out_mlt, type_name)` reads a GGUF file with gguf-py's reader and
maps the architecture's hyperparameters to the metadata keys of docs/formats.md. With type_name
None (the default) every matrix keeps the file's type: its blocks are copied byte for byte
(f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs,
mxfp4; ggml's layouts, docs/formats.md), nothing is dequantized and quantized again; a matrix of
another type (IQ2_XXS, IQ3_S, ...) is refused with a message naming it and the --type to use. With a type_name, every tensor is
dequantized (krafla_twisted/convert/quantize.py; gguf-py's dequantizers for the types ours lack)
and the matrices are quantized to that type. Vectors (norms, biases) are f32 either way. Tensor
names stay GGUF's (Phi-3's fused attn_qkv and gate/up ffn_up are split into the llama names, by
whole rows, so kept blocks split too). Supported architectures: llama (Llama 3.1's
rope_freqs.weight kept; a Mistral GGUF is llama too), qwen2, qwen3, phi3, smollm3, gemma3, and
the mixtures of experts of convert/moe.py (qwen3moe, olmoe, mixtral, gpt-oss: its YaRN written
as rope_freqs.weight, convert/rope.py); anything else is refused with a message that says what is missing. The .mlt names the chat
template the GGUF's own tokenizer.chat_template renders like (krafla_twisted/chat/template_file.py).
"""

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from krafla_twisted.convert import quantize, rope
from krafla_twisted.engine import formats

OUTPUT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q2_K", "q3_K", "iq4_nl", "iq4_xs", "mxfp4")  # what --type requantizes to
# Types of 32-weight blocks and of 256-weight super-blocks among them: a matrix whose rows do not split
# into its type's blocks falls back as llama-quantize does (super-blocks to iq4_nl, then f16).
_SUPER_BLOCK_FALLBACK = "iq4_nl"
# GGUF type -> the krafla type its blocks are copied as (the same bytes) when the file's types are kept
KEPT_TYPES = {
    "F32": formats.F32, "F16": formats.F16, "BF16": formats.BF16, "Q8_0": formats.Q8_0, "Q4_0": formats.Q4_0,
    "Q4_1": formats.Q4_1, "Q5_0": formats.Q5_0, "Q5_1": formats.Q5_1,
    "Q4_K": formats.Q4_K, "Q5_K": formats.Q5_K, "Q6_K": formats.Q6_K,
    "Q2_K": formats.Q2_K, "Q3_K": formats.Q3_K, "IQ4_NL": formats.IQ4_NL, "IQ4_XS": formats.IQ4_XS,
    "MXFP4": formats.MXFP4,
}
_CHUNK_WEIGHTS = 1 << 23  # weights dequantized at once: bounds the converter's extra memory
# Byte offsets of the f16 scales (d; m or dmin) in a block of each kept block type (docs/formats.md).
# Every weight is d * q (- dmin * m, + m) with small integers q and m, so the block's weights are
# all finite exactly when these floats are. MXFP4's scale is an E8M0 byte, finite for every value.
_SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                  "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
                  "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}


class ConvertError(ValueError):
    """A source model that cannot be converted: names the file and the problem."""


@dataclass(frozen=True)
class Architecture:
    rope_style: str  # "norm" (llama.cpp permuted q/k to adjacent pairs) or "neox"
    activation: str
    layer_tensors: tuple  # per-layer tensor names (without "blk.N.")
    gemma: bool = False  # gemma3: scaled embeddings, sliding-window layers, local rope base
    fused: bool = False  # phi3: attn_qkv and a double-height ffn_up, split into the llama names


_LLAMA_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                "ffn_down.weight")

ARCHITECTURES = {
    "llama": Architecture("norm", "silu", _LLAMA_LAYER),
    "qwen2": Architecture("neox", "silu", _LLAMA_LAYER + ("attn_q.bias", "attn_k.bias", "attn_v.bias")),
    "gemma3": Architecture("neox", "gelu_tanh", _LLAMA_LAYER + (
        "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
        gemma=True),
    "qwen3": Architecture("neox", "silu", _LLAMA_LAYER + ("attn_q_norm.weight", "attn_k_norm.weight")),
    # llama.cpp permutes SmolLM3's q/k rows as it does Llama's
    "smollm3": Architecture("norm", "silu", _LLAMA_LAYER),
    "phi3": Architecture("neox", "silu", ("attn_norm.weight", "attn_qkv.weight", "attn_output.weight",
                                          "ffn_norm.weight", "ffn_up.weight", "ffn_down.weight"), fused=True),
    # the mixtures of experts (convert/moe.py adds the router, experts and q/k norms); llama.cpp's
    # Mixtral is a llama GGUF with experts
    "qwen3moe": Architecture("neox", "silu", _LLAMA_LAYER[:6]),
    "olmoe": Architecture("neox", "silu", _LLAMA_LAYER[:6]),
    "mixtral": Architecture("norm", "silu", _LLAMA_LAYER[:6]),
    # llama.cpp names gpt-oss's norm before the experts post_attention_norm: krafla's ffn_norm
    "gpt-oss": Architecture("neox", "silu", _LLAMA_LAYER[:5] + ("post_attention_norm.weight",)),
}
# gpt-oss in a GGUF: the SwiGLU constants and the layer pattern llama.cpp hard-codes rather than
# stores (transformers' GptOssConfig defaults: sliding-window layers 0, 2, 4, ...).
GPT_OSS_SLIDING_WINDOW_PATTERN = 2
_GPT_OSS_RENAMED = {"post_attention_norm.weight": "ffn_norm.weight"}
# SmolLM3 leaves q and k unrotated in every fourth layer; llama.cpp's GGUF does not store the
# pattern (its loader hard-codes the period), transformers' config calls it no_rope_layer_interval.
SMOLLM3_NO_ROPE_INTERVAL = 4
# Tensors a GGUF may carry besides the layers: llama.cpp's Llama 3.1 RoPE divisors (one per pair).
_ROPE_FREQS = "rope_freqs.weight"
_REFUSED_TENSORS = {
    "rope_factors_long.weight": "LongRoPE (Phi-3.5, Phi-4-mini and the 128k Phi-3 models) is not supported",
    "rope_factors_short.weight": "LongRoPE (Phi-3.5, Phi-4-mini and the 128k Phi-3 models) is not supported",
}

# Gemma 3: five sliding-window layers, then one full-attention layer (transformers'
# Gemma3TextConfig sliding_window_pattern = 6; llama.cpp's set_swa_pattern(6)).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_THETA_LOCAL = 10000.0  # transformers' rope_local_base_freq

# "SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m", "model-f16": the quantization label
# llama.cpp's tools put at the end of a file name.
_QUANT_SUFFIX = re.compile(r"[._-](?:i?q\d(?:_[a-z0-9]+)*|f16|f32|bf16)$", re.IGNORECASE)


def model_base_name(path):
    """`dir/SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`."""
    stem = Path(path).name
    for extension in (".gguf", ".mlb", ".mlt"):
        if stem.lower().endswith(extension):
            stem = stem[: -len(extension)]
    return _QUANT_SUFFIX.sub("", stem) or stem


def source_label(path):
    """The quantization label of a GGUF's name (`X.Q4_1.gguf` -> `Q4_1`, `x-q4_k_m.gguf` ->
    `Q4_K_M`), or None: what a conversion that keeps the file's types is named after."""
    stem = Path(path).name
    if stem.lower().endswith(".gguf"):
        stem = stem[:-len(".gguf")]
    match = _QUANT_SUFFIX.search(stem)
    return match.group(0)[1:].upper() if match else None


def output_names(src, type_name=None, directory=None, *, name=None):
    """Default outputs beside `src` (or in `directory`), NAME-LABEL.mlb and NAME-LABEL.mlt: NAME
    the source's base name (or `name`), LABEL Q4_0 for --type q4_0, else the source's own label
    (e.g. Q4_K_M), or NATIVE when its name has none."""
    folder = Path(directory) if directory is not None else Path(src).parent
    label = type_name.upper() if type_name else source_label(src) or "NATIVE"
    stem = f"{name or model_base_name(src)}-{label}"
    return folder / f"{stem}.mlb", folder / f"{stem}.mlt"


def file_type_label(reader, type_name=None):
    """What a converted file's matrices are, as llama.cpp names a file type (the `file_type` key of
    docs/formats.md): the --type it was converted to (`Q4_0`), else the GGUF's `general.file_type`
    (`Q4_K_M`: mostly q4_K with q6_K, and q5_0 or q8_0 where rows are too short for super-blocks),
    or None when the GGUF does not say."""
    import gguf

    if type_name:
        return type_name.upper()
    field = reader.fields.get("general.file_type")
    try:
        name = gguf.LlamaFileType(int(field.contents())).name
    except (AttributeError, TypeError, ValueError):  # absent, not an integer, or not a type llama.cpp names
        return None
    if name == "GUESSED":
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


class _Fields:
    """Typed access to a GGUF file's key/value metadata, with errors naming the file."""

    def __init__(self, reader, path):
        self.reader, self.path = reader, path

    def get(self, key, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key, what):
        value = self.get(key)
        if value is None:
            raise ConvertError(f"{self.path}: metadata {key} ({what}) is missing")
        return value

    def integer(self, key, what, default=None):
        value = self.get(key) if default is not None else self.require(key, what)
        if value is None:
            return default
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                raise ConvertError(f"{self.path}: metadata {key} ({what}) differs between layers: "
                                   f"{value}; per-layer values are not supported")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ConvertError(f"{self.path}: metadata {key} ({what}) is {value!r}, expected a positive integer")
        return int(value)

    def real(self, key, what, default=None):
        value = self.get(key) if default is not None else self.require(key, what)
        if value is None:
            return float(default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value):
            raise ConvertError(f"{self.path}: metadata {key} ({what}) is {value!r}, expected a number")
        # GGUF stores these as float32: keep the shortest decimal that is the same float32
        # (1e-05, not 9.999999747378752e-06), which is the value the model's config had.
        return float(str(np.float32(value)))


def hyperparameters(reader, path="<gguf>"):
    """The .mlb metadata (docs/formats.md) from a GGUF reader, except `name`."""
    fields = _Fields(reader, path)
    arch_name = fields.get("general.architecture")
    if arch_name is None:
        raise ConvertError(f"{path}: metadata general.architecture is missing; is this a model GGUF?")
    from krafla_twisted.convert import moe

    moe_arch = moe.gguf_arch(arch_name, fields, f"{arch_name}.")
    if arch_name not in ARCHITECTURES or arch_name == "mixtral":
        raise ConvertError(f"{path}: architecture {arch_name!r} is not supported; krafla converts "
                           f"{', '.join(ARCHITECTURES)} (no tensor mapping or hyperparameters for {arch_name!r})")
    arch = ARCHITECTURES[arch_name]
    p = f"{arch_name}."
    dim = fields.integer(p + "embedding_length", "embedding width")
    n_heads = fields.integer(p + "attention.head_count", "attention heads")
    n_kv_heads = fields.integer(p + "attention.head_count_kv", "key/value heads", default=n_heads)
    if n_heads % n_kv_heads:
        raise ConvertError(f"{path}: {n_heads} attention heads is not a multiple of {n_kv_heads} key/value heads")
    head_dim = fields.integer(p + "attention.key_length", "head width", default=dim // n_heads)
    value_dim = fields.integer(p + "attention.value_length", "value head width", default=head_dim)
    if value_dim != head_dim:
        raise ConvertError(f"{path}: key head width {head_dim} and value head width {value_dim} differ; "
                           "krafla needs them equal")
    n_layers = fields.integer(p + "block_count", "transformer blocks")
    rope_dims = fields.integer(p + "rope.dimension_count", "rotated head dimensions", default=head_dim)
    if rope_dims > head_dim or rope_dims % 2:
        raise ConvertError(f"{path}: {rope_dims} rotated dimensions does not fit a head of {head_dim}")
    rope_theta = fields.real(p + "rope.freq_base", "RoPE base", default=10000.0)

    rope_scale = 1.0
    scaling = fields.get(p + "rope.scaling.type")
    gpt_oss = arch_name == "gpt-oss"
    if gpt_oss and scaling == "yarn":
        scaling = None  # _yarn's: rope_freqs.weight and attn_scale
    if scaling not in (None, "none", "linear"):
        raise ConvertError(f"{path}: RoPE scaling {scaling!r} is not supported (linear, and llama3 through "
                           "rope_freqs.weight)")
    if scaling == "linear":
        rope_scale = fields.real(p + "rope.scaling.factor", "linear RoPE scale")

    metadata = {
        "arch": arch_name,
        "n_vocab": 0,  # filled in from token_embd.weight
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "ffn_dim": fields.integer(p + "feed_forward_length", "MLP width"),
        "max_seq": fields.integer(p + "context_length", "trained context length"),
        "norm_eps": fields.real(p + "attention.layer_norm_rms_epsilon", "RMSNorm epsilon"),
        "rope_theta": rope_theta,
        "rope_theta_local": rope_theta,
        "rope_scale": rope_scale,
        "rope_style": arch.rope_style,
        "rope_dims": rope_dims,
        "activation": arch.activation,
        "tied_embeddings": 0,
        "embedding_scale": 1.0,
        "attn_scale": fields.real(p + "attention.scale", "attention scale", default=1.0 / math.sqrt(head_dim)),
        "sliding_window": 0,
        "layer_types": [0] * n_layers,
        "attn_softcap": fields.real(p + "attn_logit_softcapping", "attention soft-cap", default=0.0),
        "final_softcap": fields.real(p + "final_logit_softcapping", "logit soft-cap", default=0.0),
    }
    if arch.gemma:
        metadata["embedding_scale"] = math.sqrt(dim)
        metadata["rope_theta_local"] = fields.real(p + "rope.freq_base_swa", "local RoPE base",
                                                   default=GEMMA3_ROPE_THETA_LOCAL)
        metadata["sliding_window"] = fields.integer(p + "attention.sliding_window", "sliding window")
        metadata["layer_types"] = _gemma3_layer_types(fields, p + "attention.sliding_window_pattern", n_layers)
    elif arch_name == "phi3":
        # llama.cpp writes 0 when the model has no window (Phi-4); else every layer slides
        window = fields.get(p + "attention.sliding_window") or 0
        if window:
            if rope_scale != 1.0:
                raise ConvertError(f"{path}: RoPE scaling together with a sliding window is not supported")
            metadata["sliding_window"] = fields.integer(p + "attention.sliding_window", "sliding window")
            metadata["layer_types"] = [1] * n_layers
    elif gpt_oss:
        metadata["sliding_window"] = fields.integer(p + "attention.sliding_window", "sliding window")
        metadata["layer_types"] = _gemma3_layer_types(fields, p + "attention.sliding_window_pattern", n_layers,
                                                      GPT_OSS_SLIDING_WINDOW_PATTERN)
        yarn = _yarn(fields, p, metadata)
        if yarn is not None:  # q and k each scaled by the attention factor: their scores by its square
            metadata["attn_scale"] *= yarn[1] ** 2
    if arch_name == "smollm3":
        metadata["layer_rope"] = [int((i + 1) % SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(n_layers)]
    if moe_arch:
        metadata.update(moe.gguf_metadata(moe_arch, fields, p, path))
    return metadata


def _yarn(fields, p, metadata):
    """rope.yarn_rope's (divisors, attention factor) when the GGUF's rope.scaling.type is yarn, else
    None. llama.cpp's GGUF has no `truncate`: gpt-oss was trained with the correction range's ends
    left unrounded (its config's truncate false, OpenAI's reference), as taken here, where
    llama.cpp's own runtime floors and ceils them."""
    if fields.get(p + "rope.scaling.type") != "yarn":
        return None
    for key in ("yarn_ext_factor", "yarn_attn_factor"):
        value = fields.get(p + "rope.scaling." + key)
        if value is not None and float(value) != 1.0:
            raise ConvertError(f"{fields.path}: metadata {p}rope.scaling.{key} is {value}; only 1 is supported")
    return rope.yarn_rope(metadata["rope_theta"], metadata["rope_dims"],
                          fields.real(p + "rope.scaling.factor", "YaRN factor"),
                          fields.integer(p + "rope.scaling.original_context_length", "YaRN original context"),
                          fields.real(p + "rope.scaling.yarn_beta_fast", "YaRN beta_fast", default=32.0),
                          fields.real(p + "rope.scaling.yarn_beta_slow", "YaRN beta_slow", default=1.0),
                          truncate=False)


def _gemma3_layer_types(fields, key, n_layers, default_period=None):
    """1 (sliding window) or 0 (full attention) per layer; the file's pattern wins if it has one
    (gpt-oss uses the same rule with its own period)."""
    pattern = fields.get(key)
    if isinstance(pattern, list):  # one flag per layer, true = sliding window
        if len(pattern) != n_layers:
            raise ConvertError(f"{fields.path}: metadata {key} has {len(pattern)} entries for {n_layers} layers")
        return [1 if sliding else 0 for sliding in pattern]
    period = (default_period or GEMMA3_SLIDING_WINDOW_PATTERN) if pattern is None else int(pattern)
    if period <= 0:
        raise ConvertError(f"{fields.path}: metadata {key} is {pattern!r}, expected a positive integer")
    return [0 if (i + 1) % period == 0 else 1 for i in range(n_layers)]


def _expected_shapes(metadata, arch):
    """GGUF tensor name -> numpy shape (rows, columns) for every tensor the model must have."""
    dim, head_dim, ffn = metadata["dim"], metadata["head_dim"], metadata["ffn_dim"]
    q_rows, kv_rows = metadata["n_heads"] * head_dim, metadata["n_kv_heads"] * head_dim
    per_layer = {
        "attn_norm.weight": (dim,),
        "attn_q.weight": (q_rows, dim),
        "attn_k.weight": (kv_rows, dim),
        "attn_v.weight": (kv_rows, dim),
        "attn_output.weight": (dim, q_rows),
        "attn_q.bias": (q_rows,),
        "attn_k.bias": (kv_rows,),
        "attn_v.bias": (kv_rows,),
        "attn_q_norm.weight": (head_dim,),
        "attn_k_norm.weight": (head_dim,),
        "post_attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
        "ffn_gate.weight": (ffn, dim),
        "ffn_up.weight": (ffn, dim),
        "ffn_down.weight": (dim, ffn),
        "post_ffw_norm.weight": (dim,),
    }
    if arch.fused:
        per_layer["attn_qkv.weight"] = (q_rows + 2 * kv_rows, dim)
        per_layer["ffn_up.weight"] = (2 * ffn, dim)
    shapes = {"token_embd.weight": (metadata["n_vocab"], dim), "output_norm.weight": (dim,)}
    from krafla_twisted.convert import moe

    for layer in range(metadata["n_layers"]):
        for name in arch.layer_tensors:
            shapes[f"blk.{layer}.{name}"] = per_layer[name]
        if moe.is_moe(metadata["arch"]):
            shapes.update({f"blk.{layer}.{name}": shape for name, shape in moe.layer_shapes(metadata).items()})
    return shapes


def fused_parts(metadata):
    """Phi-3's fused matrices split by rows into the llama names: {fused name: {part name: (first
    row, rows)}}. attn_qkv holds the q, k, v rows in that order; ffn_up holds the gate's rows, then
    the up projection's. The Hugging Face converter splits qkv_proj and gate_up_proj the same way."""
    q_rows = metadata["n_heads"] * metadata["head_dim"]
    kv_rows = metadata["n_kv_heads"] * metadata["head_dim"]
    ffn = metadata["ffn_dim"]
    return {"attn_qkv.weight": {"attn_q.weight": (0, q_rows), "attn_k.weight": (q_rows, kv_rows),
                                "attn_v.weight": (q_rows + kv_rows, kv_rows)},
            "ffn_up.weight": {"ffn_gate.weight": (0, ffn), "ffn_up.weight": (ffn, ffn)}}


def _split_fused(metadata):
    """Every layer's parts of the fused tensors -> {output name: (source name, first row, shape)}."""
    return {f"blk.{layer}.{part}": (f"blk.{layer}.{fused}", first, (rows, metadata["dim"]))
            for layer in range(metadata["n_layers"])
            for fused, parts in fused_parts(metadata).items() for part, (first, rows) in parts.items()}


def _output_type(name, shape, type_name, tied):
    """The krafla type a tensor is stored as: vectors f32; the head (or tied embedding) q8_0 under the
    types of 4 bits and fewer; rows that do not split into the type's blocks as llama-quantize does."""
    if len(shape) == 1 or type_name == "f32":
        return formats.F32
    if type_name not in ("f16", "q8_0") and (name == "output.weight" or (tied and name == "token_embd.weight")):
        type_name = "q8_0"
    if shape[-1] % formats.TENSOR_TYPES_BY_NAME[type_name].block:
        type_name = _SUPER_BLOCK_FALLBACK if type_name in ("q2_K", "q3_K", "iq4_xs") else "f16"
        if shape[-1] % formats.TENSOR_TYPES_BY_NAME[type_name].block:
            type_name = "f16"  # rows that do not split into 32-weight blocks
    return formats.TENSOR_TYPES_BY_NAME[type_name]


def _encode(values, tensor_type):
    if tensor_type is formats.F32:
        return values
    return quantize.QUANTIZERS[tensor_type.name](values)


def _check_readable(tensor, name, shape, path, type_name):
    """ConvertError naming the tensor, its type and what to do, unless this conversion handles it:
    kept matrices must be a type the engine computes on, every other tensor one we can read."""
    gguf_type = tensor.tensor_type.name
    if type_name is None and len(shape) >= 2:  # matrices, and the stacked matrices of experts
        if gguf_type in KEPT_TYPES:
            return
        if quantize.readable(gguf_type):
            raise ConvertError(f"{path}: tensor {name} has type {gguf_type}, which krafla does not compute on "
                               f"(it keeps {', '.join(KEPT_TYPES)}); convert with --type q8_0 (or "
                               f"{', '.join(t for t in OUTPUT_TYPES if t != 'q8_0')}) to requantize the model")
    if not quantize.readable(gguf_type):
        raise ConvertError(f"{path}: tensor {name} has type {gguf_type}, which neither krafla nor gguf-py can read "
                           f"(krafla keeps {', '.join(KEPT_TYPES)}; --type requantizes from those and the "
                           "types gguf-py dequantizes)")


def _raw_rows(tensor, name, shape, gguf_type, path, source_shape=None, first_row=0):
    """The tensor's bytes as uint8 (rows, row_bytes), checked against its shape. `source_shape`,
    `first_row`: the tensor is rows first_row.. of a larger (fused) one of that shape."""
    source_shape = source_shape or shape
    n_per_row = shape[-1]
    rows = math.prod(shape[:-1])
    source_rows = math.prod(source_shape[:-1])
    raw = np.asarray(tensor.data)  # uint8 for block types, typed for F32/F16
    row_size = quantize.row_bytes(gguf_type, n_per_row)
    if raw.nbytes != source_rows * row_size:
        raise ConvertError(f"{path}: tensor {name}: {raw.nbytes} bytes of {gguf_type} do not hold shape {source_shape}")
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(source_rows, row_size)
    return raw[first_row:first_row + rows]


def all_finite(gguf_type, raw):
    """Whether every weight of these rows of a kept type (uint8 (rows, row bytes)) is finite, read
    from the floats the type stores (the weights, or each block's f16 scales) without decoding."""
    if gguf_type == "BF16":  # not finite: all eight exponent bits set
        return not ((raw.view("<u2") & 0x7F80) == 0x7F80).any()
    if gguf_type in ("F32", "F16"):
        return bool(np.isfinite(raw.view("<f4" if gguf_type == "F32" else "<f2")).all())
    blocks = raw.reshape(-1, quantize.BLOCKS[gguf_type][1])
    return all(np.isfinite(np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2")).all()
               for offset in _SCALE_OFFSETS[gguf_type])


def _tensor_data(tensor, name, shape, path, bar, encode_as=None, source_shape=None, first_row=0):
    """The tensor's rows as uint8 (rows, row bytes): its own blocks as they are (encode_as None),
    or dequantized chunk by chunk and encoded as the krafla type `encode_as`. Either way every
    weight must be finite: the engine does not check, and a NaN scale in a copied block would
    give NaN logits. `source_shape`, `first_row`: as for _raw_rows."""
    gguf_type = tensor.tensor_type.name
    n_per_row = shape[-1]
    raw = _raw_rows(tensor, name, shape, gguf_type, path, source_shape, first_row)
    non_finite = f"{path}: tensor {name} holds NaN or infinite weights"
    if encode_as is None:
        if not all_finite(gguf_type, raw):
            raise ConvertError(non_finite)
        if bar is not None:
            bar.update(raw.shape[0] * n_per_row)
        return raw
    out = None
    step = max(1, _CHUNK_WEIGHTS // n_per_row)
    for start in range(0, raw.shape[0], step):
        values = quantize.dequantize(gguf_type, raw[start:start + step], n_per_row)
        if not np.isfinite(values).all():
            raise ConvertError(non_finite)
        encoded = _encode(values, encode_as)
        if out is None:
            out = np.empty((raw.shape[0], encoded.nbytes // encoded.shape[0]), np.uint8)
        out[start:start + step] = encoded.view(np.uint8).reshape(encoded.shape[0], -1)
        if bar is not None:
            bar.update(values.size)
    return out


def _open(src, progress):
    import gguf

    if src.is_dir():
        raise ConvertError(f"{src}: is a directory; convert_gguf reads a .gguf file "
                           "(Hugging Face folders: krafla_twisted.convert.hf.convert_hf)")
    if progress:
        print(f"reading {src}", file=sys.stderr)
    try:
        return gguf.GGUFReader(src)
    except FileNotFoundError:
        raise ConvertError(f"{src}: no such file") from None
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ConvertError(f"{src}: not a readable GGUF file ({e})") from None


def _tokenizer_container(reader, src):
    """The .mlt container, with the chat template the GGUF's tokenizer.chat_template renders like
    (krafla_twisted/chat/template_file.py)."""
    from krafla_twisted.chat import template_file
    from krafla_twisted.convert.tokenizer import container_from_gguf

    try:
        container = container_from_gguf(reader)
    except ValueError as e:
        raise ConvertError(f"{src}: tokenizer: {e}") from e
    jinja = _Fields(reader, src).get("tokenizer.chat_template")
    try:
        template_file.store(container, jinja if isinstance(jinja, str) else None)
    except template_file.TemplateFileError as e:
        raise ConvertError(f"{src}: metadata tokenizer.chat_template: {e}") from None
    return container


def convert_gguf_tokenizer(src, out_mlt, progress=True):
    """Write only the .mlt of the GGUF file `src` (atomically); returns out_mlt as a Path."""
    src, out_mlt = Path(src), Path(out_mlt)
    formats.write(out_mlt, _tokenizer_container(_open(src, progress), src))
    return out_mlt


def convert_gguf(src, out_mlb, out_mlt, type_name=None, progress=True, *, name=None):
    """Convert the GGUF file `src` to `out_mlb` and `out_mlt`: matrices in the file's own types
    (type_name None), or requantized to `type_name` (one of OUTPUT_TYPES).

    `name` (the model's name in the .mlb) defaults to `out_mlb`'s name without its type label.
    Both outputs are written atomically; returns (out_mlb, out_mlt) as Paths."""
    if type_name is not None and type_name not in OUTPUT_TYPES:
        raise ConvertError(f"--type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    src, out_mlb, out_mlt = Path(src), Path(out_mlb), Path(out_mlt)
    for path in (out_mlb, out_mlt):
        if not path.parent.is_dir():
            raise ConvertError(f"{path}: directory {path.parent} does not exist")
    from krafla_twisted.convert import moe

    reader = _open(src, progress)
    metadata = hyperparameters(reader, src)
    arch = ARCHITECTURES[metadata["arch"]]
    sources = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost first
        sources[tensor.name] = (tensor, shape)
    for refused, why in _REFUSED_TENSORS.items():
        if refused in sources:
            raise ConvertError(f"{src}: tensor {refused}: {why}")
    if "token_embd.weight" not in sources:
        raise ConvertError(f"{src}: tensor token_embd.weight is missing")
    metadata["n_vocab"] = sources["token_embd.weight"][1][0]
    tied = "output.weight" not in sources
    metadata["tied_embeddings"] = int(tied)
    expected = _expected_shapes(metadata, arch)
    if not tied:
        expected["output.weight"] = (metadata["n_vocab"], metadata["dim"])
    missing = [n for n in expected if n not in sources]
    if missing:
        raise ConvertError(f"{src}: {metadata['arch']} model lacks tensors {', '.join(missing[:8])}"
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    rope_freqs = None
    if _ROPE_FREQS in sources:
        # Llama 3.1's RoPE scaling: one divisor per rotated pair, kept as it is
        rope_freqs = (metadata["rope_dims"] // 2,)
        if sources[_ROPE_FREQS][1] != rope_freqs:
            raise ConvertError(f"{src}: tensor {_ROPE_FREQS} has shape {sources[_ROPE_FREQS][1]}, expected "
                               f"{rope_freqs} (one factor per rotated pair)")
        if metadata["sliding_window"]:
            raise ConvertError(f"{src}: {_ROPE_FREQS} together with a sliding window is not supported")
        expected[_ROPE_FREQS] = rope_freqs
    yarn = _yarn(_Fields(reader, src), f"{metadata['arch']}.", metadata)
    unknown = [n for n in sources if n not in expected]
    if unknown:
        raise ConvertError(f"{src}: tensors krafla does not know for {metadata['arch']}: {', '.join(unknown[:8])}"
                           + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    for tensor_name, shape in expected.items():
        if sources[tensor_name][1] != shape:
            raise ConvertError(f"{src}: tensor {tensor_name} has shape {sources[tensor_name][1]}, "
                               f"expected {shape} from the hyperparameters")
        _check_readable(sources[tensor_name][0], tensor_name, shape, src, type_name)

    tokenizer = _tokenizer_container(reader, src)
    model = formats.Container(formats.MODEL_MAGIC)
    model.metadata["name"] = name or model_base_name(out_mlb)
    model.metadata.update(metadata)
    file_type = file_type_label(reader, type_name)
    if file_type:
        model.metadata["file_type"] = file_type
    if yarn is not None:  # gpt-oss's YaRN, as the Hugging Face converter writes it
        model.add(_ROPE_FREQS, formats.F32, yarn[0].shape, yarn[0])

    bar = None
    if progress:
        from tqdm import tqdm
        total = sum(math.prod(shape) for _, shape in sources.values())
        bar = tqdm(total=total, unit="w", unit_scale=True,
                   desc=f"converting to {type_name}" if type_name else "copying the file's blocks",
                   file=sys.stderr, leave=False)
    try:
        # token_embd, then the layers in order, then the output: the order the engine reads them.
        outputs = {name: (name, 0, shape) for name, shape in expected.items()}
        if arch.fused:
            for name in list(outputs):
                if name.endswith(("attn_qkv.weight", "ffn_up.weight")):
                    del outputs[name]
            outputs.update(_split_fused(metadata))
        if metadata["arch"] == "gpt-oss":
            for name in [n for n in outputs if n.startswith("blk.")]:
                _, layer, suffix = name.split(".", 2)
                if suffix in _GPT_OSS_RENAMED:
                    outputs[f"blk.{layer}.{_GPT_OSS_RENAMED[suffix]}"] = outputs.pop(name)
        for tensor_name in sorted(outputs, key=_tensor_order):
            source_name, first_row, shape = outputs[tensor_name]
            tensor, source_shape = sources[source_name]
            if type_name is None and len(shape) >= 2:  # kept: the blocks as they are (experts too)
                tensor_type, encode_as = KEPT_TYPES[tensor.tensor_type.name], None
            else:
                tensor_type = encode_as = (moe.output_type(tensor_name)
                                           or _output_type(tensor_name, shape, type_name or "f32", tied))
            model.add(tensor_name, tensor_type, shape,
                      _tensor_data(tensor, tensor_name, shape, src, bar, encode_as, source_shape, first_row))
    finally:
        if bar is not None:
            bar.close()

    formats.write(out_mlt, tokenizer)
    formats.write(out_mlb, model)
    return out_mlb, out_mlt


def _tensor_order(name):
    if name == "token_embd.weight":
        return (0, 0, name)
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (2, 0, name)

