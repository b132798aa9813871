"""The tokenizer file (.mlt): built from a GGUF's `tokenizer.ggml.*` metadata.

The tables keep the vocabulary as the tokenizer spells it (GPT-2's byte alphabet for byte-level
BPE, U+2581 for a space in SentencePiece) and settle here, once, every decision llama.cpp makes
when it loads a vocabulary: which pre-tokenizer a `tokenizer.ggml.pre` name means, the add_bos /
add_space_prefix / ignore_merges defaults, which tokens end a generation, the control type forced
on end-of-turn tokens, and phi-3's whitespace stripping around special tokens. The C tokenizer
(engine_c/src/tokenizer/tokenizer.c) then only follows the file. docs/formats.md lists every table.

`container_from_gguf` is the GGUF front; a Hugging Face `tokenizer.json` front (issue 7) can
produce the same `TokenizerTables` and share `build_container`.
"""

from dataclasses import dataclass, field

import numpy as np

from krafla_twisted.engine import formats

# GGUF token types (tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# tokenizer.ggml.pre -> (krafla pre-tokenizer, ignore_merges, add_bos default), as llama-vocab.cpp maps them
_LLAMA3 = ("llama3", True, True)
BPE_PRE_TOKENIZERS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False, False)),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-es", "jina-de",
                     "gigachat", "a.x-4.0", "mellum", "exaone4"], ("gpt2", False, False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"],
                    ("qwen2", False, False)),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    ("smollm", False, False)),
    "qwen35": ("qwen35", False, False),
    # OpenAI's o200k split (gpt-4o, gpt-oss); llama.cpp gives llama4, kanana2, talkie and minimax-m2 the same regex
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], ("o200k", False, False)),
}

# Spellings llama.cpp treats as end of generation (and forces to control type).
END_OF_GENERATION = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
}
# Fill-in-the-middle spellings: all forced to control type; pad/repo/file-separator also end a generation.
FIM_CONTROL = {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<|code_middle|>",
}
FIM_END_OF_GENERATION = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
                         "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"}


def end_of_generation_ids(by_text, types):
    """Ids whose spelling ends a generation (llama.cpp's lists above); those spellings and the
    fill-in-the-middle ones are forced to the control type in `types`. by_text: bytes -> id."""
    eot = set()
    for text, i in by_text.items():
        spelled = text.decode("utf-8", "replace")
        if spelled in END_OF_GENERATION or spelled in FIM_END_OF_GENERATION:
            eot.add(i)
        if spelled in END_OF_GENERATION or spelled in FIM_END_OF_GENERATION or spelled in FIM_CONTROL:
            types[i] = CONTROL
    return eot


class TokenizerConversionError(ValueError):
    """A vocabulary krafla cannot turn into a .mlt: says which field and why."""


@dataclass
class TokenizerTables:
    """Everything a .mlt holds, before it is packed into tensors."""

    kind: str                    # "bpe" or "spm"
    pre: str                     # krafla pre-tokenizer: gpt2 llama3 qwen2 smollm qwen35 o200k, or "none" for spm
    tokens: list                 # bytes: each token's spelling
    types: list                  # int: GGUF token type
    scores: list | None = None   # spm: float per token
    merges: list | None = None   # bpe: (left bytes, right bytes) in rank order
    bos_id: int = -1
    eos_id: int = -1
    unk_id: int = -1
    pad_id: int = -1
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    ignore_merges: bool = False
    eot_ids: set = field(default_factory=set)
    lstrip_ids: set = field(default_factory=set)
    rstrip_ids: set = field(default_factory=set)
    extra: dict = field(default_factory=dict)  # informational metadata (source, source_pre, name)


def _field(reader, key):
    return reader.fields.get(key)


def _scalar(reader, key, default=None):
    f = _field(reader, key)
    if f is None:
        return default
    value = f.contents()
    return value


def _string_array(reader, key):
    """A GGUF string array as raw bytes (no decoding, so any byte survives)."""
    f = _field(reader, key)
    if f is None:
        return None
    return [bytes(f.parts[i]) for i in f.data]


def _number_array(reader, key, dtype):
    f = _field(reader, key)
    if f is None:
        return None
    if not f.data:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(f.parts[i]).reshape(-1) for i in f.data]).astype(dtype)


def tables_from_gguf(reader):
    """Read a GGUF's tokenizer and apply llama.cpp's load-time rules (see the module docstring)."""
    model = _scalar(reader, "tokenizer.ggml.model")
    if model is None:
        raise TokenizerConversionError("GGUF has no tokenizer.ggml.model: no vocabulary to convert")
    source_pre = _scalar(reader, "tokenizer.ggml.pre", "default")
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerConversionError("GGUF has no tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]".encode() for i, t in enumerate(tokens)]  # llama.cpp's rename
    types = _number_array(reader, "tokenizer.ggml.token_type", np.int64)
    if types is None:
        types = np.full(n_vocab, NORMAL)
    if len(types) != n_vocab:
        raise TokenizerConversionError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens")
    types = [int(t) if 0 <= t <= BYTE else UNDEFINED for t in types]

    if model == "gpt2":
        if source_pre not in BPE_PRE_TOKENIZERS:
            raise TokenizerConversionError(
                f"tokenizer.ggml.pre = {source_pre!r}: krafla has no pre-tokenizer for it "
                f"(known: {', '.join(sorted(BPE_PRE_TOKENIZERS))})")
        pre, ignore_merges, add_bos = BPE_PRE_TOKENIZERS[source_pre]
        tables = TokenizerTables("bpe", pre, tokens, types, ignore_merges=ignore_merges, add_bos=add_bos)
        raw_merges = _string_array(reader, "tokenizer.ggml.merges")
        if not raw_merges:
            raise TokenizerConversionError("byte-level BPE vocabulary without tokenizer.ggml.merges")
        merges = []
        for merge in raw_merges:
            split = merge.find(b" ", 1)  # as llama.cpp: the first space after the first byte
            if split > 0:
                merges.append((merge[:split], merge[split + 1:]))
        tables.merges = merges
    elif model == "llama":
        scores = _number_array(reader, "tokenizer.ggml.scores", np.float32)
        if scores is None or len(scores) != n_vocab:
            raise TokenizerConversionError("SentencePiece vocabulary needs tokenizer.ggml.scores, one per token")
        tables = TokenizerTables("spm", "none", tokens, types, scores=[float(s) for s in scores],
                                 bos_id=1, eos_id=2, unk_id=0, add_bos=True, add_space_prefix=True)
    else:
        raise TokenizerConversionError(f"tokenizer.ggml.model = {model!r}: krafla reads 'gpt2' (BPE) and 'llama' (SPM)")

    for attribute, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"), ("unk_id", "unknown_token_id"),
                           ("pad_id", "padding_token_id")):
        value = _scalar(reader, f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n_vocab:
            setattr(tables, attribute, int(value))
    for attribute, key in (("add_bos", "add_bos_token"), ("add_eos", "add_eos_token"),
                           ("add_space_prefix", "add_space_prefix")):
        value = _scalar(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            setattr(tables, attribute, bool(value))

    # End of generation, and the control type llama.cpp forces on those spellings.
    by_text = {t: i for i, t in enumerate(tokens)}  # a duplicate spelling: the last id, as llama.cpp
    eot = end_of_generation_ids(by_text, types)
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _scalar(reader, f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < n_vocab:
            eot.add(int(value))
    if tables.eos_id >= 0:
        eot.add(tables.eos_id)
    tables.eot_ids = eot

    # phi-3: whitespace after a special token is eaten (llama.cpp sets RSTRIP by model name).
    name = str(_scalar(reader, "general.name", "") or "")
    if "phi-3" in name.lower() or "phi3" in name.lower():
        special = {i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED, UNKNOWN)}
        special |= {by_text[b"</s>"]} if b"</s>" in by_text else set()
        special -= {by_text[t] for t in (b"<unk>", b"<s>", b"<|endoftext|>") if t in by_text}
        tables.rstrip_ids = special
    tables.extra = {"source": "gguf", "source_model": str(model), "source_pre": str(source_pre), "name": name}
    return tables


def build_container(tables):
    """Pack TokenizerTables into the .mlt container (layout in docs/formats.md)."""
    n_vocab = len(tables.tokens)
    if tables.kind not in ("bpe", "spm"):
        raise TokenizerConversionError(f"tokenizer kind {tables.kind!r} is not bpe or spm")
    if tables.add_bos and tables.bos_id < 0:
        raise TokenizerConversionError("add_bos is set but the vocabulary has no bos token")
    if tables.add_eos and tables.eos_id < 0:
        raise TokenizerConversionError("add_eos is set but the vocabulary has no eos token")
    container = formats.Container(formats.TOKENIZER_MAGIC)
    container.metadata.update({
        "kind": tables.kind,
        "pre": tables.pre,
        "n_vocab": n_vocab,
        "bos_id": tables.bos_id,
        "eos_id": tables.eos_id,
        "unk_id": tables.unk_id,
        "pad_id": tables.pad_id,
        "add_bos": int(tables.add_bos),
        "add_eos": int(tables.add_eos),
        "add_space_prefix": int(tables.add_space_prefix),
        "ignore_merges": int(tables.ignore_merges),
        "eot_ids": sorted(tables.eot_ids),
        "lstrip_ids": sorted(tables.lstrip_ids),
        "rstrip_ids": sorted(tables.rstrip_ids),
        **tables.extra,
    })
    offsets = np.zeros(n_vocab + 1, np.int64)
    offsets[1:] = np.cumsum([len(t) for t in tables.tokens])
    if offsets[-1] >= 2**31:
        raise TokenizerConversionError(f"{offsets[-1]} bytes of token spellings do not fit i32 offsets")
    text = np.frombuffer(b"".join(tables.tokens), np.uint8)
    container.add("token_text", formats.U8, (len(text),), text)
    container.add("token_offsets", formats.I32, (n_vocab + 1,), offsets.astype(np.int32))
    container.add("token_types", formats.I32, (n_vocab,), np.asarray(tables.types, np.int32))
    if tables.kind == "bpe":
        container.add("merges", formats.I32, *_merge_table(tables))
    else:
        container.add("token_scores", formats.F32, (n_vocab,), np.asarray(tables.scores, np.float32))
    return container


def _merge_table(tables):
    """(left, right, result) ids per merge, in rank order. A merge whose parts are not all tokens
    can never apply to ids and is left out; so is one that would spell a control or unknown token
    (plain text must never turn into one)."""
    by_text = {t: i for i, t in enumerate(tables.tokens)}
    rows = []
    for left, right in tables.merges:
        ids = (by_text.get(left), by_text.get(right), by_text.get(left + right))
        if None in ids or tables.types[ids[2]] in (CONTROL, UNKNOWN):
            continue
        rows.append(ids)
    if not rows:
        raise TokenizerConversionError("no usable BPE merges: every merge names a string outside the vocabulary")
    return (len(rows), 3), np.asarray(rows, np.int32)


def container_from_gguf(reader):
    """The .mlt container for a `gguf.GGUFReader`'s vocabulary."""
    return build_container(tables_from_gguf(reader))
