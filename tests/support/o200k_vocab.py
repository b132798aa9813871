"""Vocabularies with OpenAI's o200k split (gpt-4o, gpt-oss), as the two files krafla converts.

TEXTS: a fixed corpus for the split and the encode. `tiny_folder(folder)`: a small byte-level BPE vocabulary that Hugging Face's `tokenizers` trains on
CORPUS below with the o200k Split regex, saved as tokenizer.json (+ tokenizer_config.json). Training
is deterministic, so every run gets the same merges; the test suite needs no stored vocabulary.

`write_gguf(gguf_path, tokens, types, merges, eos_id)`: a vocabulary-only GGUF as llama.cpp's
converter writes one for these models (`tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.pre =
"gpt-4o"`). `gguf_from_folder` writes it from a tokenizer.json; tests/reference/test_o200k.py writes
the real o200k vocabulary with it.
"""

import json
from pathlib import Path

import gguf

# tiktoken's o200k_base pat_str (tiktoken_ext/openai_public.py), the regex of gpt-oss's tokenizer.json.
REGEX = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
SPECIAL = ["<|endoftext|>", "<|return|>"]
CONTROL = 3

# Mixed script and case, contractions, digits, paths and whitespace runs: merges that span each kind.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we're here; they'll see, I'd say.",
    "HelloWorld XMLHttpRequest getElementById camelCase snake_case SCREAMING_CASE McDonald's O'Neil",
    "Ünïcödé naïve café résumé déjà vu Ærøskøbing Straße ΣΊΣΥΦΟΣ Σίσυφος Москва москва",
    "中文分词测试 日本語のテキスト 한국어 텍스트 ǅungla ǈubljana ʰaʼ ʻokina",
    "path/to/file.txt ../up/one https://example.com/a/b?c=1 C:\\Windows\\System32\n/usr/bin/env",
    "  indented\n\n\tdouble newline\r\nwindows line\n    four spaces   trailing  \n",
    "numbers 1 12 123 1234 12345 3.14159 1,000,000 ١٢٣٤ Ⅻ ⅷ ½",
    "emoji 😀😃 👩\u200d💻 🦙 ✨ and marks e\u0301 a\u0308 o\u0302 गुणवत्ता ภาษาไทย",
    "DON'T YOU'LL WE'RE I'M SHE'S THEY'VE HE'D 'S 'T 'RE",
    "def f(x):\n    return x**2 // 3  # comment\n{\"key\": [1, 2, 3]}\n",
]

# Where o200k's split differs from the llama3 family's: case changes inside words, letters that sit on
# both sides of one (Lm, Lo, marks), contractions that stay on their word, '/' after punctuation.
TEXTS = CORPUS + [
    "HelloWorld's XMLHttpRequest iPhone eBay ABCdef abcDEF ǅungla ǅUNGLA ǈǈǈ ᾈᾈa",
    "中A A中 中a a中B ʰA Aʰ aʰB \u0301A A\u0301 a\u0301 \u0301a \u0301\u0301 x \u0301'S \u0301'T",
    "I'M YOU'RE it'S 'ſ it'ſ x'LL x'Ll 've 'VE 's 'S", "a/b !/ !\n/ ./.. //x \r\n/ ?\n\n//\r\n",
    "1 12 123 1234 ١٢٣٤ Ⅻⅻ  \t\n  \n\n x  \u3000\u00a0y\u2028z",
]


def tiny_folder(folder, vocab_size=600):
    """Train the small vocabulary and save it in `folder`; returns the folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 3, trainer=trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[0], "add_bos_token": False}))
    return folder


def write_gguf(path, tokens, types, merges, eos_id):
    """A vocabulary-only GGUF: tokens (GPT-2 byte alphabet str), GGUF token types, merges "a b"."""
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(eos_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_from_folder(folder, path):
    """The GGUF of a tokenizer.json's vocabulary: added special tokens become control tokens."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in data["added_tokens"]}
    by_id.update(special)
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [CONTROL if i in special else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return write_gguf(path, tokens, types, merges, tokens.index(SPECIAL[0]))
