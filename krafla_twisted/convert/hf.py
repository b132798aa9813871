"""Hugging Face folder -> krafla: config.json + *.safetensors (+ tokenizer.json) to .mlb and .mlt.

`convert_hf(folder, out_mlb, out_mlt, type_name)` reads the checkpoint with our own safetensors
reader (an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw data; no torch), maps llama (with Llama 3.1's RoPE scaling), qwen2, qwen3,
mistral, phi3, smollm3, gemma3 and qwen3_5 text models to the tensor names and metadata keys of
docs/formats.md, and encodes the matrices as `type_name` with
the same quantizers as the GGUF path. Vision towers and multi-token-prediction heads are skipped
with a message. The tokenizer comes from tokenizer.json (convert/tokenizer_json.py).

Conventions (Hugging Face -> .mlb):
- q/k rows stay as they are: transformers rotates halves, so rope_style is `neox`.
- Gemma's and Qwen3.5's RMSNorm multiply by (1 + w): the .mlb stores 1 + w. Qwen3.5's gated
  norm inside the DeltaNet layer multiplies by w and is copied unchanged.
- Qwen3.5 DeltaNet: A_log becomes ssm_a = -exp(A_log); dt_bias becomes ssm_dt.bias.
- Phi-3's qkv_proj (q, k, v rows) and gate_up_proj (gate rows, then up) are split by rows.
- Llama 3.1's rope_type llama3 becomes the tensor rope_freqs.weight (one divisor per pair, as
  llama.cpp writes it), and so does gpt-oss's yarn (convert/rope.py; its attention factor squared
  folded into attn_scale); SmolLM3's no_rope_layers becomes layer_rope.
- The mixtures of experts (qwen3_moe, mixtral, olmoe, gpt_oss) are moe.py's.
- The model's own chat template (tokenizer_config.json, chat_template.jinja) is named in the .mlt
  (krafla_twisted/chat/template_file.py).
"""

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

from krafla_twisted.convert import gguf as gguf_convert
from krafla_twisted.convert import moe, rope
from krafla_twisted.convert.gguf import OUTPUT_TYPES, ConvertError
from krafla_twisted.engine import formats

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
           "I64": np.dtype("<i8")}  # I64: BERT checkpoints' position_ids buffer, never converted
_MAX_HEADER = 100 << 20


# --- safetensors


class SafetensorsFile:
    """One .safetensors file: `.names`, `.shape(name)`, `.get(name) -> float32 ndarray` (memory-mapped)."""

    def __init__(self, path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ConvertError(f"{self.path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                raise ConvertError(f"{self.path}: safetensors header of {length} bytes does not fit the file")
            try:
                header = json.loads(f.read(length))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConvertError(f"{self.path}: safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{self.path}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self._base = 8 + length
        self._size = size
        self._entries = header
        self._map = None
        for name, entry in header.items():
            self._check(name, entry)

    def _check(self, name, entry):
        try:
            dtype, shape, (begin, end) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{self.path}: tensor {name}: malformed header entry") from None
        if dtype == "U8" and name.endswith(("_blocks", "_scales")):
            raise ConvertError(f"{self.path}: tensor {name} holds MXFP4 blocks (gpt-oss's released experts), "
                               "which the folder converter does not read; convert a GGUF of the model instead")
        if dtype not in _DTYPES:
            raise ConvertError(f"{self.path}: tensor {name} has dtype {dtype}; krafla reads "
                               f"{', '.join(_DTYPES)}")
        expected = math.prod(shape) * _DTYPES[dtype].itemsize
        if not (0 <= begin <= end and end - begin == expected and self._base + end <= self._size):
            raise ConvertError(f"{self.path}: tensor {name}: bytes {begin}..{end} do not hold {dtype} {shape} "
                               "inside the file")

    @property
    def names(self):
        return list(self._entries)

    def shape(self, name):
        return tuple(int(d) for d in self._entries[name]["shape"])

    def get(self, name, start=None, stop=None):
        """The tensor as float32, or only rows [start, stop) of its first axis."""
        entry = self._entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, "r")
        begin, end = entry["data_offsets"]
        raw = self._map[self._base + begin:self._base + end]
        values = raw.view(_DTYPES[entry["dtype"]]).reshape(self.shape(name))
        if start is not None:
            values = values[start:stop]
        if entry["dtype"] == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(values, dtype=np.float32)


def open_checkpoint(folder):
    """name -> SafetensorsFile holding it, for model.safetensors or a sharded index."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{index}: not a safetensors index ({e})") from None
        files = {}
        where = {}
        for name, shard in weight_map.items():
            if shard not in files:
                path = folder / shard
                if not path.is_file():
                    raise ConvertError(f"{index}: shard {shard} is missing")
                files[shard] = SafetensorsFile(path)
            if name not in files[shard].names:
                raise ConvertError(f"{index}: {name} is not in {shard}")
            where[name] = files[shard]
        return where
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise ConvertError(f"{folder}: no *.safetensors files")
    where = {}
    for path in paths:
        st = SafetensorsFile(path)
        for name in st.names:
            where[name] = st
    return where


# --- config


def _load_config(folder):
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder}: no config.json; is this a Hugging Face model folder?")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path}: not JSON ({e})") from None


ARCHS = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3",
         "qwen3_5_text": "qwen35", "qwen3_5": "qwen35", "qwen3": "qwen3", "mistral": "mistral",
         "phi3": "phi3", "smollm3": "smollm3", **moe.HF_MODEL_TYPES}


def llama3_rope_factors(theta, rope_dims, factor, low_freq_factor, high_freq_factor, original_context):
    """Llama 3.1's RoPE scaling as one divisor per rotated pair (what llama.cpp stores as
    rope_freqs.weight): 1 for wavelengths shorter than original_context / high_freq_factor,
    `factor` for those longer than original_context / low_freq_factor, and in between the
    divisor that blends the two smoothly (Meta's reference implementation of Llama 3.1)."""
    if high_freq_factor <= low_freq_factor:
        raise ConvertError(f"llama3 RoPE scaling: high_freq_factor {high_freq_factor} must exceed "
                           f"low_freq_factor {low_freq_factor}")
    low_wavelength = original_context / low_freq_factor
    high_wavelength = original_context / high_freq_factor
    factors = []
    for i in range(rope_dims // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / rope_dims)
        if wavelength < high_wavelength:
            factors.append(1.0)
        elif wavelength > low_wavelength:
            factors.append(float(factor))
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


_ROPE_REFUSALS = {
    "longrope": "LongRoPE (Phi-3.5, Phi-4-mini and the 128k Phi-3 models: short and long factors with an "
                "attention factor) is not supported",
    "su": "LongRoPE (Phi-3's 'su' scaling) is not supported",
    "yarn": "YaRN RoPE scaling is not supported; remove rope_scaling from config.json to run the model "
            "at its original context",
    "dynamic": "dynamic NTK RoPE scaling is not supported",
}


def _rope(config, layer_type=None, default_theta=10000.0, path="<config>", yarn=False):
    """(theta, linear factor, partial rotary factor, llama3 parameters or None) from
    rope_parameters or the older flat keys (rope_theta, rope_scaling); a key the config leaves out
    takes transformers' default. With `yarn` (gpt-oss), rope_type yarn is taken: its parameters
    are read by _yarn."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if layer_type and layer_type in params:
        params = params[layer_type]
    theta = params.get("rope_theta", config.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if yarn and kind == "yarn":
        return float(theta), 1.0, float(params.get("partial_rotary_factor", 1.0)), None
    if kind in _ROPE_REFUSALS:
        raise ConvertError(f"{path}: RoPE type {kind!r}: {_ROPE_REFUSALS[kind]}")
    if kind not in ("default", "linear", "llama3"):
        raise ConvertError(f"{path}: RoPE type {kind!r} is not supported (default, linear, llama3)")
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    llama3 = None
    if kind == "llama3":
        llama3 = (float(params.get("factor", 8.0)), float(params.get("low_freq_factor", 1.0)),
                  float(params.get("high_freq_factor", 4.0)),
                  float(params.get("original_max_position_embeddings", 8192)))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return float(theta), factor, float(partial), llama3


def hyperparameters(config, path="<config>"):
    """(arch, text config, .mlb metadata without n_vocab/name/tied_embeddings)."""
    model_type = config.get("model_type")
    if model_type not in ARCHS:
        raise ConvertError(f"{path}: model_type {model_type!r} is not supported "
                           f"({', '.join(sorted(ARCHS))})")
    arch = ARCHS[model_type]
    text = config.get("text_config") if model_type in ("gemma3", "qwen3_5") else config
    if not isinstance(text, dict):
        raise ConvertError(f"{path}: {model_type} config has no text_config")
    if "vision_config" in config:
        print(f"{path}: skipping the vision model; converting the language model only", file=sys.stderr)

    def need(key):
        if key not in text:
            raise ConvertError(f"{path}: config key {key} is missing")
        return text[key]

    dim, n_layers, n_heads = int(need("hidden_size")), int(need("num_hidden_layers")), int(need("num_attention_heads"))
    n_kv = int(text.get("num_key_value_heads") or n_heads)
    gemma, qwen35 = arch == "gemma3", arch == "qwen35"
    # Sub-configs saved by older transformers list only non-default values: Gemma 3's defaults.
    head_dim = int(text.get("head_dim") or (256 if gemma else dim // n_heads))
    layer_names = text.get("layer_types")
    if qwen35 and not layer_names:
        interval = int(text.get("full_attention_interval", 4))
        layer_names = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if gemma and not layer_names:
        period = int(text.get("sliding_window_pattern", 6))
        layer_names = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]
    if arch in ("mistral", "phi3") and not layer_names:
        # transformers' Mistral and Phi-3 slide every layer's window when the config sets one
        layer_names = ["sliding_attention" if text.get("sliding_window") else "full_attention"] * n_layers
    if arch == "gpt-oss" and not layer_names:  # GptOssConfig's default: sliding, full, sliding, ...
        layer_names = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    layer_names = layer_names or ["full_attention"] * n_layers
    if len(layer_names) != n_layers:
        raise ConvertError(f"{path}: layer_types has {len(layer_names)} entries for {n_layers} layers")
    codes = {"full_attention": 0, "sliding_attention": 1, "linear_attention": 2}
    if any(name not in codes for name in layer_names):
        raise ConvertError(f"{path}: unknown layer types in {sorted(set(layer_names))}")
    sliding = "sliding_attention" in layer_names
    window = int(text.get("sliding_window") or 0) if sliding else 0
    if sliding and window < 1:
        raise ConvertError(f"{path}: sliding-window layers but sliding_window is {text.get('sliding_window')!r}")
    gpt_oss = arch == "gpt-oss"
    theta, factor, partial, llama3 = _rope(text, "full_attention" if gemma else None,
                                           1e6 if gemma else 150000.0 if gpt_oss else 10000.0, path, yarn=gpt_oss)
    if sliding and not gemma and (factor != 1.0 or llama3):
        raise ConvertError(f"{path}: RoPE scaling together with sliding-window layers is supported for gemma3 only")
    theta_local = theta
    if gemma:
        sliding_params = (text.get("rope_parameters") or {}).get("sliding_attention")
        theta_local = (float(sliding_params["rope_theta"]) if sliding_params
                       else float(text.get("rope_local_base_freq", 10000.0)))
    rope_dims = int(head_dim * partial) if arch in ("qwen35", "phi3") else head_dim
    if rope_dims % 2 or rope_dims > head_dim or rope_dims < 2:
        raise ConvertError(f"{path}: {rope_dims} rotated dimensions do not fit a head of {head_dim}")
    act = (text.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else (text.get("hidden_act") or "silu")
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if activation is None:
        raise ConvertError(f"{path}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    if text.get("attention_bias") and arch not in ("qwen2", "gpt-oss"):
        raise ConvertError(f"{path}: attention biases are only supported for qwen2 and gpt-oss")
    attn_scale = float(text.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else head_dim ** -0.5
    yarn = _yarn(text, theta, rope_dims, path) if gpt_oss else None
    if yarn is not None:  # q and k each scaled by the attention factor: their scores by its square
        attn_scale *= yarn[1] ** 2
    metadata = {
        "arch": arch,
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": head_dim,
        "ffn_dim": int(need("intermediate_size")),
        "max_seq": int(text.get("max_position_embeddings", 4096)),
        "norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_theta_local": theta_local,
        "rope_scale": factor,
        "rope_style": "neox",
        "rope_dims": rope_dims,
        "activation": activation,
        "embedding_scale": math.sqrt(dim) if gemma else 1.0,
        "attn_scale": attn_scale,
        "sliding_window": window,
        "layer_types": [codes[name] for name in layer_names],
        "attn_softcap": 0.0,  # transformers' Gemma 3 does not apply attn_logit_softcapping
        "final_softcap": float(text.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
    }
    if arch == "smollm3":
        # no_rope_layers: 1 where the layer rotates q and k, 0 where it does not (every fourth)
        interval = int(text.get("no_rope_layer_interval", 4))
        flags = text.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
        if len(flags) != n_layers or any(flag not in (0, 1) for flag in flags):
            raise ConvertError(f"{path}: no_rope_layers {flags!r} is not one 0/1 flag per layer")
        metadata["layer_rope"] = [int(flag) for flag in flags]
    if qwen35:
        metadata.update({
            "linear_conv_kernel": int(text.get("linear_conv_kernel_dim", 4)),
            "linear_k_heads": int(need("linear_num_key_heads")),
            "linear_v_heads": int(need("linear_num_value_heads")),
            "linear_k_head_dim": int(need("linear_key_head_dim")),
            "linear_v_head_dim": int(need("linear_value_head_dim")),
        })
        if metadata["linear_v_heads"] % metadata["linear_k_heads"]:
            raise ConvertError(f"{path}: linear value heads are not a multiple of linear key heads")
    if moe.is_moe(arch):
        metadata.update(moe.hf_metadata(arch, text, path))
    return arch, text, metadata


# --- tensor names

_COMMON = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAMES = {
    "llama": {**_COMMON, "post_attention_layernorm.weight": "ffn_norm.weight"},
    "qwen2": {**_COMMON, "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias"},
    "gemma3": {**_COMMON, "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight",
               "post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "qwen3": {**_COMMON, "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "qwen35": {**_COMMON, "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight",
               "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
               "linear_attn.in_proj_z.weight": "attn_gate.weight",
               "linear_attn.in_proj_b.weight": "ssm_beta.weight",
               "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
               "linear_attn.conv1d.weight": "ssm_conv1d.weight",
               "linear_attn.dt_bias": "ssm_dt.bias",
               "linear_attn.A_log": "ssm_a",
               "linear_attn.norm.weight": "ssm_norm.weight",
               "linear_attn.out_proj.weight": "ssm_out.weight"},
}


_LAYER_NAMES["mistral"] = _LAYER_NAMES["smollm3"] = _LAYER_NAMES["llama"]
# Phi-3 fuses q, k, v into one matrix (rows in that order) and gate, up into another: the
# converter splits them into the llama names by rows.
_LAYER_NAMES["phi3"] = {"input_layernorm.weight": "attn_norm.weight",
                        "post_attention_layernorm.weight": "ffn_norm.weight",
                        "self_attn.o_proj.weight": "attn_output.weight",
                        "mlp.down_proj.weight": "ffn_down.weight"}
# Hugging Face's fused matrix -> the GGUF name whose row split gguf.fused_parts gives.
_FUSED = {"phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}}


def _plus_one(arch, name):
    """Norms that multiply by (1 + w) in transformers: stored with the 1 added (not Qwen3.5's gated norm)."""
    if arch == "gemma3":
        return name.endswith("norm.weight")
    return arch == "qwen35" and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight")


_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIPPED = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.", "multi_modal_projector.",
            "model.multi_modal_projector.", "mtp.")


def expected_shapes(metadata):
    """krafla tensor name -> shape for every tensor of the model (output.weight when untied)."""
    m = metadata
    dim, hd, ffn = m["dim"], m["head_dim"], m["ffn_dim"]
    arch = m["arch"]
    shapes = {"token_embd.weight": (m["n_vocab"], dim), "output_norm.weight": (dim,)}
    if not m["tied_embeddings"]:
        shapes["output.weight"] = (m["n_vocab"], dim)
    q_rows, kv_rows = m["n_heads"] * hd, m["n_kv_heads"] * hd
    for i, kind in enumerate(m["layer_types"]):
        s = {"attn_norm.weight": (dim,), "ffn_norm.weight": (dim,), "ffn_gate.weight": (ffn, dim),
             "ffn_up.weight": (ffn, dim), "ffn_down.weight": (dim, ffn)}
        if kind == 2:
            key_dim = m["linear_k_heads"] * m["linear_k_head_dim"]
            value_dim = m["linear_v_heads"] * m["linear_v_head_dim"]
            conv_dim = 2 * key_dim + value_dim
            s.update({"attn_qkv.weight": (conv_dim, dim), "attn_gate.weight": (value_dim, dim),
                      "ssm_beta.weight": (m["linear_v_heads"], dim), "ssm_alpha.weight": (m["linear_v_heads"], dim),
                      "ssm_conv1d.weight": (conv_dim, m["linear_conv_kernel"]),
                      "ssm_dt.bias": (m["linear_v_heads"],), "ssm_a": (m["linear_v_heads"],),
                      "ssm_norm.weight": (m["linear_v_head_dim"],), "ssm_out.weight": (dim, value_dim)})
        else:
            s.update({"attn_q.weight": ((2 if arch == "qwen35" else 1) * q_rows, dim),
                      "attn_k.weight": (kv_rows, dim), "attn_v.weight": (kv_rows, dim),
                      "attn_output.weight": (dim, q_rows)})
            if arch == "qwen2":
                s.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
            if arch in ("gemma3", "qwen35", "qwen3"):
                s.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
            if arch == "gemma3":
                s.update({"post_attention_norm.weight": (dim,), "post_ffw_norm.weight": (dim,)})
        if moe.is_moe(arch):  # the experts in place of the MLP
            for dense in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
                del s[dense]
            s.update(moe.layer_shapes(m))
        for name, shape in s.items():
            shapes[f"blk.{i}.{name}"] = shape
    return shapes


def _map_names(arch, names, path, metadata):
    """krafla name -> Hugging Face name (or, for a part of a fused matrix, its name, first row and
    rows); unknown tensors are an error, vision/MTP ones skipped."""
    layer_names = _LAYER_NAMES.get(arch, {})  # the MoE architectures: moe.py's
    mapped, skipped, unknown = {}, [], []
    for hf_name in names:
        if hf_name.startswith(_SKIPPED):
            skipped.append(hf_name)
            continue
        if hf_name.endswith("rotary_emb.inv_freq"):  # older checkpoints save RoPE's cache: recomputed
            continue
        if hf_name in ("lm_head.weight", "language_model.lm_head.weight"):
            mapped["output.weight"] = hf_name
            continue
        rest = next((hf_name[len(p):] for p in _PREFIXES if hf_name.startswith(p)), None)
        if rest is None:
            unknown.append(hf_name)
        elif rest == "embed_tokens.weight":
            mapped["token_embd.weight"] = hf_name
        elif rest == "norm.weight":
            mapped["output_norm.weight"] = hf_name
        elif rest.startswith("layers."):
            _, layer, suffix = rest.split(".", 2)
            if suffix in layer_names:
                mapped[f"blk.{int(layer)}.{layer_names[suffix]}"] = hf_name
            elif moe.is_moe(arch) and moe.map_hf_layer_tensor(int(layer), suffix, hf_name, metadata, mapped):
                pass
            elif suffix in _FUSED.get(arch, {}):  # each part: (the fused matrix, first row, its rows)
                parts = gguf_convert.fused_parts(metadata)[_FUSED[arch][suffix]]
                total = sum(rows for _, rows in parts.values())
                for part, (first, _) in parts.items():
                    mapped[f"blk.{int(layer)}.{part}"] = (hf_name, first, total)
            else:
                unknown.append(hf_name)
        else:
            unknown.append(hf_name)
    if skipped:
        print(f"{path}: skipping {len(skipped)} vision / multi-token-prediction tensors", file=sys.stderr)
    if unknown:
        raise ConvertError(f"{path}: tensors krafla does not know for {arch}: {', '.join(unknown[:8])}"
                           + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    moe.finish_hf_mapping(mapped, metadata, path)
    return mapped


def _values(arch, name, values):
    """A Hugging Face tensor as the .mlb stores it (float32)."""
    if name.endswith("ssm_conv1d.weight"):
        return values.reshape(values.shape[0], -1)  # (conv_dim, 1, kernel) -> (conv_dim, kernel)
    if name.endswith("ssm_a"):
        return (-np.exp(values.astype(np.float64))).astype(np.float32)
    if _plus_one(arch, name):
        return values + np.float32(1)
    return values


def _output_type(name, shape, type_name, tied):
    if name.endswith("ssm_conv1d.weight"):
        return formats.F32
    return moe.output_type(name) or gguf_convert._output_type(name, shape, type_name, tied)


def _convert_tensor(st, hf_name, arch, krafla_name, shape, tensor_type, src, fused=None):
    """One tensor encoded as `tensor_type`; matrices a few million weights at a time, so a large
    embedding never needs a whole float32 copy. `fused`: (first row, rows of the whole fused
    matrix) when the tensor is a part of a fused matrix (Phi-3's qkv_proj, gate_up_proj)."""
    base = 0
    if fused is not None:
        base, total_rows = fused
        if st.shape(hf_name) != (total_rows, shape[1]):
            raise ConvertError(f"{src}: tensor {hf_name} has shape {st.shape(hf_name)}, expected "
                               f"{(total_rows, shape[1])} from config.json")

    def checked(values, expected_shape):
        if values.shape != expected_shape:
            raise ConvertError(f"{src}: tensor {hf_name} has shape {st.shape(hf_name)}, expected {shape} "
                               "from config.json")
        if not np.isfinite(values).all():
            raise ConvertError(f"{src}: tensor {hf_name} holds NaN or infinite weights")
        return gguf_convert._encode(values, tensor_type)

    if fused is None and (len(shape) != 2 or st.shape(hf_name) != shape or krafla_name.endswith("ssm_conv1d.weight")):
        return checked(_values(arch, krafla_name, st.get(hf_name)), shape)
    rows, cols = shape
    step = max(1, gguf_convert._CHUNK_WEIGHTS // cols)
    out = None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        encoded = checked(_values(arch, krafla_name, st.get(hf_name, base + start, base + stop)),
                          (stop - start, cols))
        encoded = np.ascontiguousarray(encoded).view(np.uint8).reshape(stop - start, -1)
        if out is None:
            out = np.empty((rows, encoded.shape[1]), np.uint8)
        out[start:stop] = encoded
    return out.reshape(-1)


def _chat_template(folder):
    """(where, Jinja text or None): chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or a list of named templates of which `default` is taken)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file, jinja_file.read_text(encoding="utf-8")
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return config_path, None
    try:
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ConvertError(f"{config_path}: not a JSON object ({e})") from None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ConvertError(f"{config_path}: chat_template is {type(template).__name__}, expected a string")
    return config_path, template


def _yarn(text, theta, rope_dims, path):
    """yarn_rope's (divisors, attention factor) for a config whose rope_type is yarn, else None."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ConvertError(f"{path}: YaRN RoPE without original_max_position_embeddings")
    factor = params.get("factor") or float(text.get("max_position_embeddings", 0)) / float(original)
    if not factor or float(factor) < 1:
        raise ConvertError(f"{path}: YaRN RoPE factor {factor!r} is not a number of at least 1")
    return rope.yarn_rope(theta, rope_dims, float(factor), float(original), float(params.get("beta_fast") or 32),
                     float(params.get("beta_slow") or 1), bool(params.get("truncate", True)),
                     params.get("attention_factor"), params.get("mscale"), params.get("mscale_all_dim"))


def _rope_freq_factors(text, metadata, path):
    """The per-pair RoPE divisors (float32, rope_dims / 2) when config.json asks for rope_type
    llama3 (Llama 3.1) or, for gpt-oss, yarn; else None."""
    if metadata["arch"] == "gpt-oss":
        yarn = _yarn(text, metadata["rope_theta"], metadata["rope_dims"], path)
        return None if yarn is None else yarn[0]
    *_, llama3 = _rope(text, None, 10000.0, path)
    if llama3 is None:
        return None
    factor, low, high, original = llama3
    return llama3_rope_factors(metadata["rope_theta"], metadata["rope_dims"], factor, low, high, original)


def convert_hf(src, out_mlb, out_mlt, type_name="q4_0", progress=True, *, name=None):
    """Convert the Hugging Face folder `src` to `out_mlb` (and `out_mlt` from tokenizer.json unless
    it is None). Returns (out_mlb, out_mlt) as Paths."""
    if type_name not in OUTPUT_TYPES:
        raise ConvertError(f"--type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    src, out_mlb = Path(src), Path(out_mlb)
    out_mlt = Path(out_mlt) if out_mlt is not None else None
    for path in (out_mlb, out_mlt):
        if path is not None and not path.parent.is_dir():
            raise ConvertError(f"{path}: directory {path.parent} does not exist")
    if not src.is_dir():
        raise ConvertError(f"{src}: not a folder")
    config = _load_config(src)
    arch, text, metadata = hyperparameters(config, src / "config.json")
    where = open_checkpoint(src)
    mapped = _map_names(arch, list(where), src, metadata)
    if "token_embd.weight" not in mapped:
        raise ConvertError(f"{src}: no embed_tokens.weight in the checkpoint")
    embd = where[mapped["token_embd.weight"]].shape(mapped["token_embd.weight"])
    metadata["n_vocab"] = int(embd[0])
    metadata["tied_embeddings"] = int("output.weight" not in mapped)
    expected = expected_shapes(metadata)
    rope_freqs = _rope_freq_factors(text, metadata, src / "config.json")
    missing = [n for n in expected if n not in mapped]
    if missing:
        raise ConvertError(f"{src}: {arch} model lacks tensors {', '.join(missing[:8])}")
    extra = [n for n in mapped if n not in expected]
    if extra:
        raise ConvertError(f"{src}: tensors that do not fit the config: {', '.join(extra[:8])}")

    tokenizer = None
    if out_mlt is not None:
        from krafla_twisted.convert.tokenizer_json import container_from_folder
        try:
            tokenizer = container_from_folder(src, n_vocab=metadata["n_vocab"])
        except ValueError as e:
            raise ConvertError(f"{src}: tokenizer: {e}") from e
        from krafla_twisted.chat import template_file
        where_template, jinja = _chat_template(src)
        try:
            template_file.store(tokenizer, jinja)
        except template_file.TemplateFileError as e:
            raise ConvertError(f"{where_template}: {e}") from None

    model = formats.Container(formats.MODEL_MAGIC)
    model.metadata["name"] = name or str(config.get("_name_or_path") or "").split("/")[-1] or src.name
    model.metadata.update(metadata)
    model.metadata["file_type"] = type_name.upper()
    tied = bool(metadata["tied_embeddings"])
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(expected), unit="tensor", desc=f"converting to {type_name}", file=sys.stderr, leave=False)
    try:
        if rope_freqs is not None:
            model.add("rope_freqs.weight", formats.F32, rope_freqs.shape, rope_freqs)
        for krafla_name in sorted(expected, key=gguf_convert._tensor_order):
            hf_name, fused = mapped[krafla_name], None
            shape = expected[krafla_name]
            tensor_type = _output_type(krafla_name, shape, type_name, tied)
            if isinstance(hf_name, moe.Columns):  # gpt-oss's interleaved gate/up biases
                model.add(krafla_name, tensor_type, shape, moe.convert_columns(where, hf_name, krafla_name, shape, src))
                if bar is not None:
                    bar.update(1)
                continue
            if isinstance(hf_name, moe.Stack):  # experts, one tensor each or fused: merged
                model.add(krafla_name, tensor_type, shape,
                          moe.convert_stack(where, hf_name, krafla_name, shape, tensor_type, gguf_convert._encode, src))
                if bar is not None:
                    bar.update(1)
                continue
            if isinstance(hf_name, tuple):  # a part of a fused matrix: (first row, rows of the whole)
                hf_name, fused = hf_name[0], hf_name[1:]
            model.add(krafla_name, tensor_type, shape,
                      _convert_tensor(where[hf_name], hf_name, arch, krafla_name, shape, tensor_type, src, fused))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if tokenizer is not None:
        formats.write(out_mlt, tokenizer)
    formats.write(out_mlb, model)
    return out_mlb, out_mlt
