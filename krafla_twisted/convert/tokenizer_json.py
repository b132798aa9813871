"""The tokenizer file (.mlt) from a Hugging Face folder: tokenizer.json + tokenizer_config.json.

Byte-level BPE (the tokenizers of llama 3, qwen2, qwen3.5, SmolLM, GPT-2, gpt-oss): the vocabulary in
tokenizer.json is already spelled in GPT-2's byte alphabet, as the .mlt stores it. The
pre-tokenizer is recognised from its split regex (or GPT-2's ByteLevel regex, or SmolLM's
individual digits), added tokens become control (special) or user-defined tokens, ids missing
from the vocabulary become unused `[PAD{i}]` tokens (up to the model's embedding rows, as
llama.cpp's converter pads), and the end-of-generation rules are the GGUF path's
(convert/tokenizer.py), whose `build_container` packs the tables.

SentencePiece-style BPE (Llama 2, TinyLlama, Gemma: `byte_fallback`, spaces spelled U+2581)
becomes a `spm` table. Its merge scores are not in tokenizer.json, but Hugging Face's converter
wrote the merges in the order of those scores, so a token's score is minus the rank of the first
merge that makes it (tokens no merge makes score below all of them): the same merge order.
`<0xXX>` pieces are byte tokens, the unk_token is unknown, and a `Prepend("▁")` normalizer or a
Metaspace pre-tokenizer that prepends sets add_space_prefix.
"""

import json
import re
from pathlib import Path

from krafla_twisted.convert.tokenizer import (
    BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, TokenizerConversionError, TokenizerTables, build_container,
    end_of_generation_ids)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# OpenAI's o200k split regex (tiktoken's o200k_base, as gpt-oss's tokenizer.json spells it), matched
# whole: a variant would need its own splitter.
O200K_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def _pre_tokenizer(pre):
    """(krafla pre name, ignore_merges) for a tokenizer.json pre_tokenizer."""
    if pre is None:
        raise TokenizerConversionError("tokenizer.json has no pre_tokenizer; krafla needs a byte-level BPE split")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regexes = [s.get("pattern", {}).get("Regex", "") for s in steps if s.get("type") == "Split"]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if not byte_level:
        raise TokenizerConversionError("tokenizer.json's pre_tokenizer has no ByteLevel step: not byte-level BPE")
    if not regexes:
        if byte_level[0].get("use_regex", True):
            return ("smollm", False) if digits else ("gpt2", False)
        raise TokenizerConversionError("tokenizer.json: ByteLevel without a split regex is not supported")
    regex = regexes[0]
    if regex == O200K_REGEX:
        return "o200k", False
    if "\\p{Lu}" not in regex:  # the others' words ignore case; another case-splitting regex is refused below
        if "\\p{M}" in regex:
            return "qwen35", False
        if "\\p{N}{1,3}" in regex:
            return "llama3", True
        if "(?i:'s|'t|'re|'ve|'m|'ll|'d)" in regex and "\\p{N}|" in regex:
            return "qwen2", False
    raise TokenizerConversionError(f"tokenizer.json split regex {regex[:80]!r} is not one krafla knows "
                                   "(gpt2, llama3, qwen2, qwen35, smollm, o200k)")


def _token_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tables_from_json(tokenizer, config=None, n_vocab=None):
    """TokenizerTables from parsed tokenizer.json (and tokenizer_config.json) contents."""
    config = config or {}
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerConversionError(f"tokenizer.json model type {model.get('type')!r}: krafla reads BPE")
    vocab = model.get("vocab") or {}
    added = tokenizer.get("added_tokens") or []
    ids = list(vocab.values()) + [t["id"] for t in added]
    size = max(ids) + 1 if ids else 0
    if n_vocab is not None:
        if size > n_vocab:
            raise TokenizerConversionError(f"tokenizer.json has ids up to {size - 1}, the model only {n_vocab} rows")
        size = n_vocab
    if size == 0:
        raise TokenizerConversionError("tokenizer.json has an empty vocabulary")
    tokens = [None] * size
    types = [UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text.encode(), NORMAL
    for t in added:
        tokens[t["id"]] = t["content"].encode()
        types[t["id"]] = CONTROL if t.get("special") else USER_DEFINED
    for i in range(size):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]".encode()
        elif not tokens[i]:
            tokens[i] = f"[EMPTY_{i}]".encode()
    spm = bool(model.get("byte_fallback")) or "\u2581" in json.dumps(tokenizer.get("normalizer"), ensure_ascii=False)
    if spm:
        pre, ignore_merges = "none", False
    else:
        pre, ignore_merges = _pre_tokenizer(tokenizer.get("pre_tokenizer"))
    if model.get("ignore_merges"):
        ignore_merges = True
    merges = []
    for merge in model.get("merges") or []:
        if isinstance(merge, str):
            left, sep, right = merge.partition(" ")
            if not sep:
                continue
        else:
            left, right = merge
        merges.append((left.encode(), right.encode()))
    if not merges:
        raise TokenizerConversionError("tokenizer.json has no BPE merges")

    by_text = {t: i for i, t in enumerate(tokens)}
    if spm:
        tables = _spm_tables(tokenizer, model, tokens, types, merges, by_text)
    else:
        tables = TokenizerTables("bpe", pre, tokens, types, merges=merges, ignore_merges=ignore_merges)
    for attribute, key in (("bos_id", "bos_token"), ("eos_id", "eos_token"), ("unk_id", "unk_token"),
                           ("pad_id", "pad_token")):
        text = _token_text(config.get(key))
        if text is not None and text.encode() in by_text:
            setattr(tables, attribute, by_text[text.encode()])
    tables.add_bos = bool(config.get("add_bos_token", pre in ("llama3", "none"))) and tables.bos_id >= 0
    tables.add_eos = bool(config.get("add_eos_token", False)) and tables.eos_id >= 0
    eot = end_of_generation_ids(by_text, tables.types)
    if tables.eos_id >= 0:
        eot.add(tables.eos_id)
    tables.eot_ids = eot
    tables.extra = {"source": "tokenizer.json", "source_model": "BPE (SentencePiece)" if spm else "BPE",
                    "source_pre": pre,
                    "name": str(config.get("name_or_path") or "")}
    return tables


def _spm_tables(tokenizer, model, tokens, types, merges, by_text):
    """The spm table: byte/unknown types, scores from merge ranks, the space prefix."""
    for i, text in enumerate(tokens):
        if types[i] == NORMAL and _BYTE_TOKEN.fullmatch(text.decode("utf-8", "replace")):
            types[i] = BYTE
    n_merges = len(merges)
    scores = [float(-(n_merges + i)) for i in range(len(tokens))]
    for rank in range(n_merges - 1, -1, -1):  # the first merge making a token wins
        left, right = merges[rank]
        made = by_text.get(left + right)
        if made is not None:
            scores[made] = float(-rank)
    tables = TokenizerTables("spm", "none", tokens, types, scores=scores)
    unk = model.get("unk_token")
    if unk is not None and unk.encode() in by_text:
        tables.unk_id = by_text[unk.encode()]
        if types[tables.unk_id] in (NORMAL, CONTROL):
            types[tables.unk_id] = UNKNOWN
    normalizer = json.dumps(tokenizer.get("normalizer"), ensure_ascii=False)
    pre = tokenizer.get("pre_tokenizer") or {}
    prepend = '"Prepend"' in normalizer or (pre.get("type") == "Metaspace" and pre.get("prepend_scheme", "always") != "never")
    tables.add_space_prefix = prepend
    return tables


def container_from_folder(folder, n_vocab=None):
    """The .mlt container of a Hugging Face folder's tokenizer.json (+ tokenizer_config.json)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerConversionError(f"{folder}: no tokenizer.json (krafla builds the .mlt from it)")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return build_container(tables_from_json(tokenizer, config, n_vocab))
