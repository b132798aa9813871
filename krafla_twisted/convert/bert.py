"""BERT-family Hugging Face folder -> krafla: an encoder .mlb (arch `bert`) and a WordPiece .mlt.

`convert_bert(folder, out_mlb, out_mlt, type_name)` reads config.json (model_type bert), the
safetensors checkpoint (convert/hf.py's reader), the vocabulary (tokenizer.json's WordPiece model,
else vocab.txt) with tokenizer_config.json's normalisation flags, and, for a sentence-transformers
folder, its pooling (1_Pooling/config.json) and whether a Normalize module follows (modules.json).
A BertForSequenceClassification (a cross-encoder) keeps its pooler and classifier as `cls.*`.

Tensor names follow llama.cpp's `bert` (docs/formats.md, "Encoders"):
    embeddings.word_embeddings          token_embd.weight          (n_vocab, dim), the chosen type
    embeddings.position_embeddings      position_embd.weight       (max_seq, dim) f32
    embeddings.token_type_embeddings    token_types.weight         (n_token_types, dim) f32
    embeddings.LayerNorm                token_embd_norm.weight/bias
    layer.i.attention.self.query/key/value   blk.i.attn_q/k/v.weight/bias
    layer.i.attention.output.dense      blk.i.attn_output.weight/bias
    layer.i.attention.output.LayerNorm  blk.i.attn_output_norm.weight/bias
    layer.i.intermediate.dense          blk.i.ffn_up.weight/bias
    layer.i.output.dense                blk.i.ffn_down.weight/bias
    layer.i.output.LayerNorm            blk.i.layer_output_norm.weight/bias
    pooler.dense, classifier            cls.weight/bias, cls.output.weight/bias (cross-encoders)
Metadata beyond the common keys: pooling (mean, cls), normalize (0/1), n_token_types, n_labels.

`convert_bert_gguf` reads the same model from a GGUF file llama.cpp's convert_hf_to_gguf.py wrote
(the tensor names are the same; the vocabulary's spelling is turned back into WordPiece's), and
llama.cpp's `nomic-bert` (nomic-embed-text): arch `nomic-bert`, RoPE (rope_theta from
nomic-bert.rope.freq_base, rope_style neox) instead of position_embd, no biases, a SwiGLU MLP
(blk.i.ffn_gate.weight beside ffn_up and ffn_down, activation silu), and its fused
blk.i.attn_qkv.weight split by rows into attn_q, attn_k and attn_v (q, k, v in that order).
"""

import json
from pathlib import Path

import numpy as np

from krafla_twisted.convert import gguf as gguf_convert
from krafla_twisted.convert.gguf import OUTPUT_TYPES, ConvertError
from krafla_twisted.engine import formats

POOLINGS = ("mean", "cls")

_LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
_TOP = {
    "embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
    "pooler.dense": "cls", "classifier": "cls.output",
}
# Kept as f32 whatever --type is: the C side reads them as float rows (arch_bert.c).
_F32_ALWAYS = ("position_embd.weight", "token_types.weight", "cls.weight", "cls.output.weight")


def is_bert(folder):
    """True when `folder`'s config.json describes a BERT encoder."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type") == "bert"
    except (OSError, ValueError, AttributeError):
        return False


def _read_json(path, default=None):
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path}: not JSON ({e})") from None


def krafla_name(hf_name):
    """The .mlb name of a BERT checkpoint tensor, or None for one krafla does not use."""
    name = hf_name[len("bert."):] if hf_name.startswith("bert.") else hf_name
    stem, _, kind = name.rpartition(".")
    if kind == "gamma":
        kind = "weight"
    elif kind == "beta":
        kind = "bias"
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) > 3 and parts[0] == "encoder" and parts[1] == "layer" and parts[2].isdigit():
        inner = ".".join(parts[3:])
        if inner in _LAYER:
            return f"blk.{int(parts[2])}.{_LAYER[inner]}.{kind}"
    return None


def hyperparameters(config, path):
    def need(key):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConvertError(f"{path}: {key} = {value!r}, expected a positive integer")
        return value

    dim, heads = need("hidden_size"), need("num_attention_heads")
    if dim % heads:
        raise ConvertError(f"{path}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ConvertError(f"{path}: hidden_act {config.get('hidden_act')!r}; krafla's bert computes gelu (erf)")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ConvertError(f"{path}: position_embedding_type {config.get('position_embedding_type')!r}; "
                           "krafla's bert has absolute positions")
    labels = 0
    if any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or ()):
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    return {
        "arch": "bert", "n_vocab": need("vocab_size"), "dim": dim, "n_layers": need("num_hidden_layers"),
        "n_heads": heads, "n_kv_heads": heads, "head_dim": dim // heads, "ffn_dim": need("intermediate_size"),
        "max_seq": need("max_position_embeddings"), "norm_eps": float(config.get("layer_norm_eps", 1e-12)),
        "activation": "gelu", "n_token_types": need("type_vocab_size"), "n_labels": labels,
    }


def expected_shapes(metadata):
    """Every tensor the .mlb holds for `metadata` (arch bert or nomic-bert), with its shape."""
    dim, ffn, n_labels = metadata["dim"], metadata["ffn_dim"], metadata["n_labels"]
    nomic = metadata["arch"] == "nomic-bert"  # RoPE, no biases, SwiGLU
    shapes = {
        "token_embd.weight": (metadata["n_vocab"], dim), "token_types.weight": (metadata["n_token_types"], dim),
        "token_embd_norm.weight": (dim,), "token_embd_norm.bias": (dim,),
    }
    if not nomic:
        shapes["position_embd.weight"] = (metadata["max_seq"], dim)
    matrices = (("attn_q", dim, dim), ("attn_k", dim, dim), ("attn_v", dim, dim), ("attn_output", dim, dim),
                ("ffn_up", ffn, dim), ("ffn_down", dim, ffn)) + ((("ffn_gate", ffn, dim),) if nomic else ())
    for i in range(metadata["n_layers"]):
        for part, rows, cols in matrices:
            shapes[f"blk.{i}.{part}.weight"] = (rows, cols)
            if not nomic:
                shapes[f"blk.{i}.{part}.bias"] = (rows,)
        for part in ("attn_output_norm", "layer_output_norm"):
            shapes[f"blk.{i}.{part}.weight"] = shapes[f"blk.{i}.{part}.bias"] = (dim,)
    if n_labels:
        shapes.update({"cls.weight": (dim, dim), "cls.bias": (dim,), "cls.output.weight": (n_labels, dim),
                       "cls.output.bias": (n_labels,)})
    return shapes


def sentence_pooling(folder, n_labels):
    """(pooling, normalize) as the folder's sentence-transformers modules say; a plain BertModel
    folder is pooled by its mean, a cross-encoder by its first token, neither normalised."""
    folder = Path(folder)
    modules = _read_json(folder / "modules.json", [])
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
    pooling = "cls" if n_labels else "mean"
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            config = _read_json(folder / module.get("path", "") / "config.json", {})
            # sentence-transformers 6 writes pooling_mode; earlier releases one flag per mode
            chosen = [config["pooling_mode"]] if isinstance(config.get("pooling_mode"), str) else [mode for mode in ("mean", "cls", "max", "mean_sqrt_len", "weightedmean", "lasttoken")
                      if config.get(f"pooling_mode_{mode}_tokens") or config.get(f"pooling_mode_{mode}_token")]
            chosen = [{"cls_token": "cls", "mean_tokens": "mean"}.get(mode, mode) for mode in chosen]
            if len(chosen) != 1 or chosen[0] not in POOLINGS:
                raise ConvertError(f"{folder}: pooling {chosen or 'none'}; krafla pools by one of {', '.join(POOLINGS)}")
            pooling = chosen[0]
    return pooling, int(normalize)


def wordpiece_container(folder, n_vocab):
    """The .mlt of a BERT vocabulary: kind wordpiece, the tokens and BertTokenizer's flags."""
    folder = Path(folder)
    tokenizer = _read_json(folder / "tokenizer.json")
    config = _read_json(folder / "tokenizer_config.json", {})
    prefix, max_chars = "##", 100
    normalizer = {}
    if tokenizer is not None:
        model = tokenizer.get("model") or {}
        if model.get("type") != "WordPiece":
            raise ConvertError(f"{folder}/tokenizer.json: model {model.get('type')!r}, expected WordPiece")
        by_id = {int(i): t for t, i in model["vocab"].items()}
        for added in tokenizer.get("added_tokens") or ():
            by_id.setdefault(int(added["id"]), added["content"])
        prefix = model.get("continuing_subword_prefix", prefix)
        max_chars = int(model.get("max_input_chars_per_word", max_chars))
        normalizer = tokenizer.get("normalizer") or {}
    elif (folder / "vocab.txt").is_file():
        by_id = dict(enumerate((folder / "vocab.txt").read_text(encoding="utf-8").split("\n")))
        if by_id and by_id[len(by_id) - 1] == "":
            del by_id[len(by_id) - 1]
    else:
        raise ConvertError(f"{folder}: neither tokenizer.json nor vocab.txt")
    if sorted(by_id) != list(range(len(by_id))) or len(by_id) > n_vocab:
        raise ConvertError(f"{folder}: the vocabulary's {len(by_id)} ids are not 0..n-1 within n_vocab {n_vocab}")
    tokens = [by_id[i] for i in range(len(by_id))] + [f"[unused-{i}]" for i in range(len(by_id), n_vocab)]
    ids = {t: i for i, t in enumerate(tokens)}

    def special(key, default):
        text = config.get(key, default)
        if isinstance(text, dict):
            text = text.get("content", default)
        if text not in ids:
            raise ConvertError(f"{folder}: {key} {text!r} is not in the vocabulary")
        return ids[text]

    lowercase = normalizer.get("lowercase", config.get("do_lower_case", True))
    strip_accents = normalizer.get("strip_accents", config.get("strip_accents"))
    return _wordpiece_file(tokens, {
        "cls_id": special("cls_token", "[CLS]"), "sep_id": special("sep_token", "[SEP]"),
        "unk_id": special("unk_token", "[UNK]"), "pad_id": special("pad_token", "[PAD]"),
        "lowercase": int(bool(lowercase)),
        # BertTokenizer strips accents when asked, or when lower-casing and not told otherwise
        "strip_accents": int(bool(lowercase) if strip_accents is None else bool(strip_accents)),
        "chinese_chars": int(bool(normalizer.get("handle_chinese_chars", config.get("tokenize_chinese_chars", True)))),
        "subword_prefix": prefix, "max_chars_per_word": max_chars,
        "model_max_length": int(min(config.get("model_max_length") or 1 << 30, 1 << 30)),
    })


def _wordpiece_file(tokens, settings):
    n_vocab = len(tokens)
    container = formats.Container(formats.TOKENIZER_MAGIC)
    container.metadata.update({"kind": "wordpiece", "n_vocab": n_vocab, **settings})
    spelled = [t.encode("utf-8") for t in tokens]
    offsets = np.zeros(n_vocab + 1, np.int64)
    offsets[1:] = np.cumsum([len(t) for t in spelled])
    text = np.frombuffer(b"".join(spelled), np.uint8)
    container.add("token_text", formats.U8, (len(text),), text)
    container.add("token_offsets", formats.I32, (n_vocab + 1,), offsets.astype(np.int32))
    return container


def convert_bert(src, out_mlb, out_mlt, type_name="f16", progress=True, *, name=None):
    """Convert the BERT folder `src` to `out_mlb` (and `out_mlt` unless None). Returns both Paths."""
    from krafla_twisted.convert import hf

    if type_name not in OUTPUT_TYPES:
        raise ConvertError(f"--type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    src, out_mlb = Path(src), Path(out_mlb)
    config = _read_json(src / "config.json")
    if config is None:
        raise ConvertError(f"{src}: no config.json; is this a Hugging Face model folder?")
    metadata = hyperparameters(config, src / "config.json")
    metadata["pooling"], metadata["normalize"] = sentence_pooling(src, metadata["n_labels"])
    where = hf.open_checkpoint(src)
    mapped = {}
    for hf_name in where:
        krafla = krafla_name(hf_name)
        if krafla is not None:
            mapped[krafla] = hf_name
    expected = expected_shapes(metadata)
    missing = [n for n in expected if n not in mapped]
    if missing:
        raise ConvertError(f"{src}: bert model lacks tensors {', '.join(missing[:8])}")
    model = formats.Container(formats.MODEL_MAGIC)
    model.metadata["name"] = name or str(config.get("_name_or_path") or "").split("/")[-1] or src.name
    model.metadata.update(metadata)
    model.metadata["file_type"] = type_name.upper()
    for krafla, shape in expected.items():
        hf_name = mapped[krafla]
        tensor_type = (formats.F32 if krafla in _F32_ALWAYS
                       else gguf_convert._output_type(krafla, shape, type_name, tied=False))
        model.add(krafla, tensor_type, shape,
                  hf._convert_tensor(where[hf_name], hf_name, "bert", krafla, shape, tensor_type, src))
    if out_mlt is not None:
        formats.write(Path(out_mlt), wordpiece_container(src, metadata["n_vocab"]))
    formats.write(out_mlb, model)
    return out_mlb, Path(out_mlt) if out_mlt is not None else None


# --- From a GGUF that llama.cpp's convert_hf_to_gguf.py wrote (general.architecture bert)

_GGUF_POOLING = {1: "mean", 2: "cls", 4: "cls"}  # llama.cpp's pooling_type: mean, cls, rank
GGUF_ARCHS = ("bert", "nomic-bert")


def is_bert_gguf(path):
    """True when `path` is a GGUF file whose general.architecture is bert or nomic-bert."""
    import gguf

    try:
        return gguf_convert._Fields(gguf.GGUFReader(path), path).get("general.architecture") in GGUF_ARCHS
    except (OSError, ValueError, IndexError, KeyError):
        return False


def wordpiece_from_gguf(fields, src):
    """The WordPiece .mlt of a GGUF bert vocabulary. llama.cpp's converter spells a word-initial
    piece with a leading U+2581 and drops the `##` of a continuation; control tokens stay as they are."""
    tokens = fields.require("tokenizer.ggml.tokens", "the vocabulary")
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if fields.get("tokenizer.ggml.model") != "bert" or len(types) != len(tokens):
        raise ConvertError(f"{src}: tokenizer.ggml.model {fields.get('tokenizer.ggml.model')!r}, expected bert")
    spelled = [t if kind == 3 else t[1:] if t.startswith("\u2581") else "##" + t for t, kind in zip(tokens, types)]
    lowercase = bool(fields.get("tokenizer.ggml.normalizer.lowercase", True))

    def special(key, what):
        value = fields.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < len(tokens):
            raise ConvertError(f"{src}: metadata {key} ({what}) is missing or outside the vocabulary")
        return value

    return _wordpiece_file(spelled, {
        "cls_id": int(special("tokenizer.ggml.bos_token_id", "[CLS]")),
        "sep_id": int(special("tokenizer.ggml.seperator_token_id", "[SEP]")) if fields.get(
            "tokenizer.ggml.seperator_token_id") is not None else int(special("tokenizer.ggml.eos_token_id", "[SEP]")),
        "unk_id": int(special("tokenizer.ggml.unknown_token_id", "[UNK]")),
        "pad_id": int(special("tokenizer.ggml.padding_token_id", "[PAD]")) if fields.get(
            "tokenizer.ggml.padding_token_id") is not None else 0,
        "lowercase": int(lowercase), "strip_accents": int(lowercase), "chinese_chars": 1,
        "subword_prefix": "##", "max_chars_per_word": 100, "model_max_length": 1 << 30,
    })


def _nomic_hyperparameters(fields, arch):
    """What nomic-bert adds to bert's metadata: its RoPE and activation. A causal or RoPE-scaled
    file is refused: the engine's encoder attends both ways at the trained frequencies."""
    if fields.get(f"{arch}.attention.causal", False):
        raise ConvertError(f"{fields.path}: {arch}.attention.causal is true; krafla's encoder attends both ways")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ConvertError(f"{fields.path}: {arch}.rope.scaling.type {scaling!r}: RoPE scaling is not supported")
    return {"rope_theta": fields.real(f"{arch}.rope.freq_base", "RoPE base"), "rope_style": "neox",
            "activation": "silu"}


def convert_bert_gguf(src, out_mlb, out_mlt, type_name=None, progress=True, *, name=None):
    """Convert a GGUF bert or nomic-bert file (llama.cpp's) to `out_mlb` and `out_mlt`: matrices in
    the file's own types (type_name None) or requantized; vectors, position and type embeddings and
    the classifier f32. llama.cpp L2-normalises an embedding model's vectors by default: so does the file."""
    src, out_mlb, out_mlt = Path(src), Path(out_mlb), Path(out_mlt)
    if type_name is not None and type_name not in OUTPUT_TYPES:
        raise ConvertError(f"--type {type_name!r}: expected one of {', '.join(OUTPUT_TYPES)}")
    reader = gguf_convert._open(src, progress)
    fields = gguf_convert._Fields(reader, src)
    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConvertError(f"{src}: general.architecture {arch!r}, expected one of {', '.join(GGUF_ARCHS)}")
    sources = {t.name: (t, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    for needed in ("token_embd.weight", "token_types.weight"):
        if needed not in sources:
            raise ConvertError(f"{src}: tensor {needed} is missing")
    dim = fields.integer(f"{arch}.embedding_length", "dim")
    heads = fields.integer(f"{arch}.attention.head_count", "heads")
    if dim % heads:
        raise ConvertError(f"{src}: {arch}.embedding_length {dim} is not a multiple of the {heads} heads")
    labels = sources["cls.output.weight"][1][0] if "cls.output.weight" in sources else 0
    metadata = {
        "arch": arch, "n_vocab": sources["token_embd.weight"][1][0], "dim": dim,
        "n_layers": fields.integer(f"{arch}.block_count", "layers"), "n_heads": heads, "n_kv_heads": heads,
        "head_dim": dim // heads, "ffn_dim": fields.integer(f"{arch}.feed_forward_length", "ffn"),
        "max_seq": fields.integer(f"{arch}.context_length", "positions"),
        "norm_eps": fields.real(f"{arch}.attention.layer_norm_epsilon", "LayerNorm epsilon"),
        "activation": "gelu", "n_token_types": sources["token_types.weight"][1][0], "n_labels": labels,
        "pooling": _GGUF_POOLING.get(fields.get(f"{arch}.pooling_type", 1), "mean"), "normalize": int(not labels),
    }
    # nomic-bert's fused attn_qkv: {part: (source tensor, first row)}, q, k, v rows in that order
    parts = {}
    if arch == "nomic-bert":
        metadata.update(_nomic_hyperparameters(fields, arch))
        qkv = gguf_convert.fused_parts(metadata)["attn_qkv.weight"]
        parts = {f"blk.{i}.{part}": (f"blk.{i}.attn_qkv.weight", first)
                 for i in range(metadata["n_layers"]) for part, (first, _) in qkv.items()}
    expected = expected_shapes(metadata)
    in_file = dict.fromkeys(parts.get(n, (n,))[0] for n in expected)  # the file's names, fused ones once
    missing = [n for n in in_file if n not in sources]
    if missing:
        raise ConvertError(f"{src}: {arch} model lacks tensors {', '.join(missing[:8])}")
    model = formats.Container(formats.MODEL_MAGIC)
    model.metadata["name"] = name or fields.get("general.name") or src.stem
    model.metadata.update(metadata)
    file_type = gguf_convert.file_type_label(reader, type_name)
    if file_type:
        model.metadata["file_type"] = file_type
    for krafla, shape in expected.items():
        source_name, first_row = parts.get(krafla, (krafla, 0))
        tensor, file_shape = sources[source_name]
        want = (3 * shape[0], shape[1]) if source_name != krafla else shape  # attn_qkv: equal q, k, v rows
        if file_shape != want:
            raise ConvertError(f"{src}: tensor {source_name} has shape {file_shape}, expected {want}")
        gguf_type = tensor.tensor_type.name
        if len(shape) == 1 or krafla in _F32_ALWAYS:
            encode_as = formats.F32 if gguf_type != "F32" else None
            tensor_type = formats.F32
        elif type_name is None:
            gguf_convert._check_readable(tensor, krafla, shape, src, None)
            encode_as, tensor_type = None, gguf_convert.KEPT_TYPES[gguf_type]
        else:
            tensor_type = gguf_convert._output_type(krafla, shape, type_name, tied=False)
            encode_as = tensor_type
        data = gguf_convert._tensor_data(tensor, krafla, shape, src, None, encode_as, want, first_row)
        model.add(krafla, tensor_type, shape, data.reshape(-1))
    formats.write(out_mlt, wordpiece_from_gguf(fields, src))
    formats.write(out_mlb, model)
    return out_mlb, out_mlt
