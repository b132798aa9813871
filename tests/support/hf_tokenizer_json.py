"""A Hugging Face tokenizer.json (+ tokenizer_config.json) written from a GGUF vocabulary, for tests.

`write_hf_tokenizer(gguf_path, folder)` spells the GGUF's byte-level BPE vocabulary the way
Hugging Face's `tokenizers` library stores it: the vocab and merges (already in GPT-2's byte
alphabet in both formats), control and user-defined tokens as added tokens (special for
control), and the pre-tokenizer as a Split on the model's published regex followed by a
ByteLevel step (GPT-2: ByteLevel with its own regex). The reference environment checks that
`tokenizers` itself encodes llama.cpp's vectors with these files, so they are real
tokenizer.json files; the main suite converts them with krafla_twisted.convert.tokenizer_json.
"""

import json
from pathlib import Path

import gguf

# The split regexes of the published tokenizer.json files (llama.cpp's vocab loader uses the same).
_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
REGEXES = {
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CONTROL, USER_DEFINED = 3, 4


def _strings(reader, key):
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _spm_merges(tokens, scores, types):
    """Merges of a SentencePiece BPE vocabulary as Hugging Face's converter derives them: every
    split of a piece into two vocabulary pieces, ordered by the piece's score (then the ids)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = []
    for piece, i in vocab.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((scores[i], n, pair) for n, pair in enumerate(local))
    merges.sort(key=lambda m: -m[0])  # stable: ties keep the vocabulary order
    return [f"{left} {right}" for _, _, (left, right) in merges]


def _write_spm(reader, folder, tokens, types):
    scores = [float(s) for s in reader.fields["tokenizer.ggml.scores"].contents()]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(tokens) if types[i] == CONTROL]
    unk = tokens[int(reader.fields["tokenizer.ggml.unknown_token_id"].contents())] \
        if "tokenizer.ggml.unknown_token_id" in reader.fields else "<unk>"
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "\u2581"}]},
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": _spm_merges(tokens, scores, types)},
    }
    bos = tokens[int(reader.fields["tokenizer.ggml.bos_token_id"].contents())]
    eos = tokens[int(reader.fields["tokenizer.ggml.eos_token_id"].contents())]
    config = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "add_bos_token": True}
    return tokenizer, config


def write_hf_tokenizer(gguf_path, folder, name):
    """Write tokenizer.json and tokenizer_config.json for vocabulary `name` (a REGEXES key, gpt-2,
    or llama-spm: SentencePiece-style BPE with byte fallback, as Llama 2's tokenizer.json)."""
    reader = gguf.GGUFReader(gguf_path)
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    types = [int(t) for t in reader.fields["tokenizer.ggml.token_type"].contents()]
    if name == "llama-spm":
        return _save(folder, *_write_spm(reader, folder, tokens, types))
    merges = _strings(reader, "tokenizer.ggml.merges")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": types[i] == CONTROL} for i, t in enumerate(tokens) if types[i] in (CONTROL, USER_DEFINED)]
    added_ids = {a["id"] for a in added}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": name == "gpt-2"}
    if name == "gpt-2":
        pre = byte_level
    else:
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": REGEXES[name]}, "behavior": "Isolated", "invert": False},
            byte_level]}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": name == "llama-bpe",
                  "vocab": {t: i for i, t in enumerate(tokens) if i not in added_ids},
                  "merges": merges},
    }
    config = {}
    for key, field in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
        if field in reader.fields:
            config[key] = tokens[int(reader.fields[field].contents())]
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = bool(add_bos.contents()) if add_bos is not None else name == "llama-bpe"
    return _save(folder, tokenizer, config)


def _save(folder, tokenizer, config):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
