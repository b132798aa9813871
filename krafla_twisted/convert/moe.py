"""The mixture-of-experts architectures' share of conversion (qwen3moe, mixtral, olmoe, gpt-oss).

hf.py and gguf.py call these for the MoE parts and keep everything else (attention, norms,
embeddings, the tokenizer) as for the dense models. The .mlb layout (docs/formats.md, "Mixtures of
experts"): `ffn_dim` is one expert's hidden width, `n_experts`, `n_experts_used` and
`expert_weights_norm` (1: the chosen experts' softmax weights are renormalised to sum 1) describe
the router, and each layer holds llama.cpp's merged tensors

    blk.N.ffn_gate_inp.weight   (n_experts, dim)            the router, always f32
    blk.N.ffn_gate_exps.weight  (n_experts, ffn_dim, dim)   every expert's gate, expert after expert
    blk.N.ffn_up_exps.weight    (n_experts, ffn_dim, dim)
    blk.N.ffn_down_exps.weight  (n_experts, dim, ffn_dim)

Hugging Face checkpoints come with one tensor per expert and projection (`mlp.experts.E.gate_proj`,
Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`) or, saved by transformers 5, fused ones
(`mlp.experts.gate_up_proj` (n_experts, 2 ffn_dim, dim): the gate's rows, then up's; `down_proj`);
both are stacked into the merged tensors. llama.cpp's GGUFs already hold them merged; its Mixtral
is architecture `llama` with `llama.expert_count` set.

gpt-oss (GptOssForCausalLM) adds biases: `attn_q/k/v/output.bias`, the router's
`ffn_gate_inp.bias` (n_experts,) and `ffn_gate_exps.bias`, `ffn_up_exps.bias` (n_experts, ffn_dim),
`ffn_down_exps.bias` (n_experts, dim); each head's sink logit `attn_sinks.weight` (n_heads,); and
the keys `swiglu_alpha`, `swiglu_limit` of its clamped SwiGLU. transformers keeps its experts
transposed, input features first: `mlp.experts.gate_up_proj` (n_experts, dim, 2 ffn_dim) with the
gate's and up's columns interleaved (gate even, up odd), `down_proj` (n_experts, ffn_dim, dim).
Its YaRN RoPE becomes rope_freqs.weight and a larger attn_scale (convert/rope.py).
"""

import re
from dataclasses import dataclass

import numpy as np

from krafla_twisted.convert.gguf import ConvertError
from krafla_twisted.engine import formats

ARCHS = ("qwen3moe", "mixtral", "olmoe", "gpt-oss")
HF_MODEL_TYPES = {"qwen3_moe": "qwen3moe", "mixtral": "mixtral", "olmoe": "olmoe", "gpt_oss": "gpt-oss"}
# llama.cpp's GGUF architectures; a llama GGUF with experts is mixtral
GGUF_ARCHS = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "gpt-oss": "gpt-oss"}
ROUTER = "ffn_gate_inp.weight"
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# whether the chosen experts' weights are renormalised when the file does not say
# (llama.cpp: qwen3moe and mixtral always, olmoe never)
_NORMALIZE_DEFAULT = {"qwen3moe": 1, "mixtral": 1, "olmoe": 0, "gpt-oss": 1}
# gpt-oss's SwiGLU when the config does not say (transformers' GptOssConfig defaults)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


MoeError = ConvertError  # gguf.py imports this module inside its functions: it is imported by it


def is_moe(arch):
    return arch in ARCHS


def layer_shapes(metadata):
    """The MoE layer's own tensors (the router and the merged experts, the q/k norms) -> shapes;
    they replace the dense MLP's ffn_gate/up/down."""
    m = metadata
    dim, ffn, n = m["dim"], m["ffn_dim"], m["n_experts"]
    shapes = {ROUTER: (n, dim), "ffn_gate_exps.weight": (n, ffn, dim), "ffn_up_exps.weight": (n, ffn, dim),
              "ffn_down_exps.weight": (n, dim, ffn)}
    if m["arch"] == "qwen3moe":
        shapes.update({"attn_q_norm.weight": (m["head_dim"],), "attn_k_norm.weight": (m["head_dim"],)})
    elif m["arch"] == "olmoe":  # over the whole projection
        shapes.update({"attn_q_norm.weight": (m["n_heads"] * m["head_dim"],),
                       "attn_k_norm.weight": (m["n_kv_heads"] * m["head_dim"],)})
    elif m["arch"] == "gpt-oss":
        q_rows, kv_rows = m["n_heads"] * m["head_dim"], m["n_kv_heads"] * m["head_dim"]
        shapes.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,),
                       "attn_output.bias": (dim,), "attn_sinks.weight": (m["n_heads"],), "ffn_gate_inp.bias": (n,),
                       "ffn_gate_exps.bias": (n, ffn), "ffn_up_exps.bias": (n, ffn), "ffn_down_exps.bias": (n, dim)})
    return shapes


def output_type(name):
    """The type a MoE tensor is stored as whatever --type says, or None: the router stays f32 (as
    llama.cpp keeps it), since the choice of experts hangs on its small differences; the experts'
    biases (matrices by shape) are f32 as every bias is."""
    return formats.F32 if name.endswith(ROUTER) or name.endswith("_exps.bias") else None


# --- Hugging Face


def hf_metadata(arch, text, path):
    """The metadata a MoE config sets beyond the dense keys: ffn_dim (an expert's width), n_experts,
    n_experts_used, expert_weights_norm."""
    def need(key):
        if text.get(key) is None:
            raise MoeError(f"{path}: config key {key} is missing")
        return text[key]

    def experts():  # transformers 5 saves num_local_experts where older configs have num_experts
        return need("num_local_experts" if text.get("num_experts") is None else "num_experts")

    if arch == "qwen3moe":
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1)) != 1:
            raise MoeError(f"{path}: qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step) "
                           "is not supported; every layer must be a mixture of experts")
        ffn, n_experts, normalize = need("moe_intermediate_size"), experts(), bool(text.get("norm_topk_prob"))
    elif arch == "mixtral":
        if text.get("sliding_window"):
            raise MoeError(f"{path}: Mixtral's sliding_window {text['sliding_window']} is not supported")
        ffn, n_experts, normalize = need("intermediate_size"), experts(), True
    elif arch == "gpt-oss":  # softmax over the top-k logits: the chosen probabilities renormalised
        ffn, n_experts, normalize = need("intermediate_size"), experts(), True
        if text.get("attention_bias") is False:
            raise MoeError(f"{path}: gpt_oss without attention biases (attention_bias false) is not supported")
    else:
        ffn, n_experts, normalize = need("intermediate_size"), experts(), bool(text.get("norm_topk_prob"))
    used = int(need("num_experts_per_tok"))
    if not 1 <= used <= int(n_experts):
        raise MoeError(f"{path}: num_experts_per_tok {used} is not between 1 and the {n_experts} experts")
    if text.get("attention_bias") and arch != "gpt-oss":
        raise MoeError(f"{path}: attention biases are not supported for {arch}")
    metadata = {"ffn_dim": int(ffn), "n_experts": int(n_experts), "n_experts_used": used,
                "expert_weights_norm": int(normalize)}
    if arch == "gpt-oss":
        metadata["swiglu_alpha"] = float(text.get("swiglu_alpha") or SWIGLU_ALPHA)
        metadata["swiglu_limit"] = float(text.get("swiglu_limit") or SWIGLU_LIMIT)
    return metadata


# layer suffix -> krafla name, for the parts of a layer every MoE architecture names alike
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": ROUTER,
    "block_sparse_moe.gate.weight": ROUTER,
    # gpt-oss
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": ROUTER,
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}
_PER_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJECTION = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# gpt-oss's transposed experts: gate_up_proj's even columns are the gate's, odd ones up's
_GPT_OSS_EXPERTS = {"mlp.experts.gate_up_proj": (0, 1), "mlp.experts.down_proj": (2,)}
_FUSED = {"mlp.experts.gate_up_proj": (0, 1), "mlp.experts.down_proj": (2,),
          "block_sparse_moe.experts.gate_up_proj": (0, 1), "block_sparse_moe.experts.down_proj": (2,)}


@dataclass(frozen=True)
class Piece:
    """One expert's matrix in a checkpoint: rows [first_row, first_row + rows) of tensor `name`,
    or of its entry `index` along the first axis when the checkpoint fuses the experts. With
    `column_step` (gpt-oss), the entry is stored transposed, (cols, output rows): the matrix is the
    transpose of its columns first_row, first_row + column_step, ... (rows of them)."""
    name: str
    index: object  # int or None
    first_row: int
    rows: int
    column_step: int = 0


@dataclass(frozen=True)
class Columns:
    """A tensor that is every `step`-th column of a checkpoint's 2-D tensor `name` from `first`
    (gpt-oss's gate and up biases, interleaved in gate_up_proj_bias)."""
    name: str
    first: int
    step: int


@dataclass(frozen=True)
class Stack:
    """A merged expert tensor's sources, expert after expert."""
    pieces: tuple


def map_hf_layer_tensor(layer, suffix, hf_name, metadata, mapped):
    """Record where a MoE layer's Hugging Face tensor goes (into `mapped`, krafla name -> source;
    experts as {expert: Piece} until `finish_hf_mapping`); False when the name is not one of them."""
    if suffix in HF_LAYER_NAMES:
        mapped[f"blk.{layer}.{HF_LAYER_NAMES[suffix]}"] = hf_name
        return True
    found = _PER_EXPERT.match(suffix)
    ffn, dim = metadata["ffn_dim"], metadata["dim"]
    if found:
        expert, projection = int(found.group(1)), _PROJECTION[found.group(2)]
        rows = dim if projection == 2 else ffn
        mapped.setdefault(f"blk.{layer}.{EXPERT_TENSORS[projection]}", {})[expert] = Piece(hf_name, None, 0, rows)
        return True
    if metadata["arch"] == "gpt-oss" and suffix in _GPT_OSS_EXPERTS:
        for part, projection in enumerate(_GPT_OSS_EXPERTS[suffix]):
            rows, step = (dim, 1) if projection == 2 else (ffn, 2)
            mapped[f"blk.{layer}.{EXPERT_TENSORS[projection]}"] = {
                expert: Piece(hf_name, expert, part, rows, step) for expert in range(metadata["n_experts"])}
        return True
    if metadata["arch"] == "gpt-oss" and suffix == "mlp.experts.gate_up_proj_bias":
        mapped[f"blk.{layer}.ffn_gate_exps.bias"] = Columns(hf_name, 0, 2)
        mapped[f"blk.{layer}.ffn_up_exps.bias"] = Columns(hf_name, 1, 2)
        return True
    if suffix in _FUSED:
        for part, projection in enumerate(_FUSED[suffix]):
            rows = dim if projection == 2 else ffn
            mapped[f"blk.{layer}.{EXPERT_TENSORS[projection]}"] = {
                expert: Piece(hf_name, expert, part * ffn, rows) for expert in range(metadata["n_experts"])}
        return True
    return False


def finish_hf_mapping(mapped, metadata, path):
    """Every expert tensor's {expert: Piece} -> a Stack, checking that no expert is missing."""
    for name, source in list(mapped.items()):
        if isinstance(source, dict):
            missing = sorted(set(range(metadata["n_experts"])) - set(source))
            if missing or len(source) != metadata["n_experts"]:
                raise MoeError(f"{path}: {name} lacks experts {missing[:8]} (or has more than "
                               f"{metadata['n_experts']})")
            mapped[name] = Stack(tuple(source[e] for e in range(metadata["n_experts"])))


def convert_stack(where, stack, krafla_name, shape, tensor_type, encode, path):
    """The merged tensor of shape (n_experts, rows, cols) encoded as `tensor_type`, one expert at a
    time (encode(values float32 (rows, cols), type) -> the rows' blocks), as raw bytes."""
    _, rows, cols = shape
    out = []
    for expert, piece in enumerate(stack.pieces):
        st = where[piece.name]
        source = st.shape(piece.name)
        if piece.column_step:
            step = piece.column_step
            if (len(source) != 3 or source[0] <= piece.index or source[1] != cols
                    or source[2] < piece.first_row + step * (rows - 1) + 1):
                raise MoeError(f"{path}: tensor {piece.name} has shape {source}, which does not hold expert "
                               f"{piece.index}'s {rows} columns of {cols} (every {step} from {piece.first_row})")
            values = st.get(piece.name, piece.index, piece.index + 1)[0, :, piece.first_row::step][:, :rows].T
        elif piece.index is None:
            if source != (rows, cols):
                raise MoeError(f"{path}: tensor {piece.name} has shape {source}, expected {(rows, cols)}")
            values = st.get(piece.name)
        else:
            if len(source) != 3 or source[0] <= piece.index or source[1] < piece.first_row + rows or source[2] != cols:
                raise MoeError(f"{path}: tensor {piece.name} has shape {source}, which does not hold expert "
                               f"{piece.index}'s {rows} rows of {cols} from row {piece.first_row}")
            values = st.get(piece.name, piece.index, piece.index + 1)[0, piece.first_row:piece.first_row + rows]
        values = np.ascontiguousarray(values, np.float32)
        if not np.isfinite(values).all():
            raise MoeError(f"{path}: tensor {piece.name} (expert {expert} of {krafla_name}) holds NaN or "
                           "infinite weights")
        out.append(np.ascontiguousarray(encode(values, tensor_type)).view(np.uint8).reshape(-1))
    return np.concatenate(out)


def convert_columns(where, columns, krafla_name, shape, path):
    """A Columns tensor as float32 of `shape`."""
    st = where[columns.name]
    source = st.shape(columns.name)
    if len(source) != 2 or source[0] != shape[0] or -(-(source[1] - columns.first) // columns.step) != shape[1]:
        raise MoeError(f"{path}: tensor {columns.name} has shape {source}, which does not hold {krafla_name}'s "
                       f"{shape} as every {columns.step}th column from {columns.first}")
    values = np.ascontiguousarray(st.get(columns.name)[:, columns.first::columns.step], np.float32)
    if not np.isfinite(values).all():
        raise MoeError(f"{path}: tensor {columns.name} holds NaN or infinite values")
    return values


# --- GGUF


def gguf_arch(arch_name, fields, prefix):
    """The krafla architecture of a GGUF's general.architecture when it is a MoE one, else None."""
    if arch_name in GGUF_ARCHS:
        return GGUF_ARCHS[arch_name]
    if arch_name == "llama" and (fields.get(prefix + "expert_count") or 0) > 0:
        return "mixtral"
    return None


def gguf_metadata(arch, fields, prefix, path):
    """The MoE metadata from a GGUF's fields (llama.cpp's keys): ffn_dim is
    `expert_feed_forward_length` where the file has it (qwen3moe; its feed_forward_length is the
    dense width), else `feed_forward_length`."""
    n_experts = fields.integer(prefix + "expert_count", "experts")
    used = fields.integer(prefix + "expert_used_count", "experts per token")
    if not 1 <= used <= n_experts:
        raise MoeError(f"{path}: {prefix}expert_used_count {used} is not between 1 and the {n_experts} experts")
    if (fields.get(prefix + "expert_shared_count") or 0) > 0:
        raise MoeError(f"{path}: shared experts ({prefix}expert_shared_count) are not supported")
    ffn_key = prefix + "expert_feed_forward_length"
    ffn = fields.integer(ffn_key, "expert width") if fields.get(ffn_key) is not None else \
        fields.integer(prefix + "feed_forward_length", "MLP width")
    normalize = fields.get(prefix + "expert_weights_norm")
    normalize = _NORMALIZE_DEFAULT[arch] if normalize is None else int(bool(normalize))
    gating = fields.get(prefix + "expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise MoeError(f"{path}: {prefix}expert_gating_func {gating} is not supported (softmax, 1)")
    metadata = {"arch": arch, "ffn_dim": ffn, "n_experts": n_experts, "n_experts_used": used,
                "expert_weights_norm": normalize}
    if arch == "gpt-oss":  # llama.cpp's GGUF has no keys for them: its runtime hard-codes these
        metadata.update(swiglu_alpha=SWIGLU_ALPHA, swiglu_limit=SWIGLU_LIMIT)
    return metadata


GGUF_LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                      "ffn_norm.weight")
