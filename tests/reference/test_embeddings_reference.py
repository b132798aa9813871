"""Encoders against sentence-transformers and transformers, live (issue 27).

Random BERTs of several shapes (heads, widths, layers, an odd head width, CLS and mean pooling,
with and without Normalize) and a random cross-encoder are built here with transformers, saved as
sentence-transformers folders, converted by krafla_twisted.convert.bert and run by the C engine
through generation.embeddings: the vectors must be SentenceTransformer.encode's (cosine >= 0.9999
at f32, >= 0.999 at f16), the scores CrossEncoder.predict's raw logits, and the WordPiece ids
BertTokenizerFast's, on texts hypothesis does not need to invent: accents, CJK, punctuation runs,
control characters, long words. A random Qwen3ForCausalLM served as a decoder reranker gives the
Qwen3-Reranker model card's transformers scores.
"""

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, models
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

from krafla_twisted.convert.bert import convert_bert
from krafla_twisted.engine.wordpiece import WordPiece
from krafla_twisted.generation.embeddings import EmbeddingRuntime

TEXTS = ["Hello, World!", "naïve façade — Ångström", "東京は日本の首都です", "a\tb\nc\x07d", "x" * 120,
         "don't stop...", "İstanbul ΣΊΣΥΦΟΣ ß", "emoji 🙂 here", "The quick brown fox."]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]


def vocabulary():
    words = ["hello", "world", "the", "quick", "brown", "fox", "don", "stop", "here", "emoji", "naive", "facade"]
    extra = list(".,!?'-—…\t") + ["東", "京", "日", "本", "首", "都", "で", "す", "は", "の", "σ", "ι", "υ", "φ", "ο", "ß"]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + LETTERS + [f"##{c}" for c in LETTERS] + words + extra
    return list(dict.fromkeys(tokens))


def folder_of(tmp_path, shape, pooling, normalize, seed):
    torch.manual_seed(seed)
    vocab = vocabulary()
    config = BertConfig(vocab_size=len(vocab), max_position_embeddings=160, type_vocab_size=2, **shape)
    model = BertModel(config).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.15)
    inner = tmp_path / "transformer"
    model.save_pretrained(inner, safe_serialization=True)
    BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True).save_pretrained(inner)
    modules = [models.Transformer(str(inner), max_seq_length=160), models.Pooling(shape["hidden_size"], pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(tmp_path / "st"))
    return tmp_path / "st", st


SHAPES = [
    dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96),
    dict(hidden_size=36, num_hidden_layers=3, num_attention_heads=3, intermediate_size=50),  # head width 12, odd sizes
    dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=1, intermediate_size=128),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("cls", False)])
@pytest.mark.parametrize("type_name, bound", [("f32", 0.9999), ("f16", 0.999)])
def test_sentence_transformers_vectors(tmp_path, shape, pooling, normalize, type_name, bound):
    folder, st = folder_of(tmp_path, shape, pooling, normalize, seed=len(tmp_path.name))
    mlb, mlt = convert_bert(folder, tmp_path / "m.mlb", tmp_path / "m.mlt", type_name, progress=False)
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    assert [WordPiece(mlt).encode(t) for t in TEXTS] == [tokenizer(t)["input_ids"] for t in TEXTS]
    runtime = EmbeddingRuntime.load(mlb, mlt, threads=2)
    try:
        got = np.asarray(runtime.embed([runtime.tokenize(t) for t in TEXTS]), np.float64)
    finally:
        runtime.close()
    want = st.encode(TEXTS, convert_to_numpy=True).astype(np.float64)
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= bound, cosines


def test_cross_encoder_scores(tmp_path):
    torch.manual_seed(7)
    vocab = vocabulary()
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=160, num_labels=1)
    model = BertForSequenceClassification(config).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "ce", safe_serialization=True)
    BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True).save_pretrained(tmp_path / "ce")
    mlb, mlt = convert_bert(tmp_path / "ce", tmp_path / "ce.mlb", tmp_path / "ce.mlt", "f32", progress=False)
    runtime = EmbeddingRuntime.load(mlb, mlt)
    try:
        scores, _ = runtime.rerank(TEXTS[0], TEXTS[1:])
    finally:
        runtime.close()
    want = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict([(TEXTS[0], d) for d in TEXTS[1:]],
                                                                   activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(scores, want, atol=1e-4)
    assert np.argsort(scores).tolist() == np.argsort(want).tolist()


def test_llama_cpp_gguf(tmp_path):
    """A random BERT with the real all-MiniLM-L6-v2 vocabulary (llama.cpp's converter recognises
    only known vocabularies), turned into a GGUF by llama.cpp's convert_hf_to_gguf.py and into
    .mlb/.mlt by convert_bert_gguf: BertTokenizerFast's ids and SentenceTransformer's vectors."""
    import shutil

    from krafla_twisted.cli import models as pulled
    from krafla_twisted.convert.bert import convert_bert_gguf
    from tests.support.llama_cpp_convert import convert_hf_to_gguf

    source = pulled.pull_embedder("all-minilm-l6-v2", progress=False).mlb.parent / "source"
    folder = tmp_path / "bert"
    torch.manual_seed(11)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=512)
    model = BertModel(config).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    gguf_path = convert_hf_to_gguf(folder, tmp_path / "bert.gguf")
    mlb, mlt = convert_bert_gguf(gguf_path, tmp_path / "g.mlb", tmp_path / "g.mlt", progress=False)
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    assert [WordPiece(mlt).encode(t) for t in TEXTS] == [tokenizer(t)["input_ids"] for t in TEXTS]
    st = SentenceTransformer(modules=[models.Transformer(str(folder)), models.Pooling(32, pooling_mode="mean"),
                                      models.Normalize()], device="cpu")
    runtime = EmbeddingRuntime.load(mlb, mlt)
    try:
        got = np.asarray(runtime.embed([runtime.tokenize(t) for t in TEXTS]), np.float64)
    finally:
        runtime.close()
    want = st.encode(TEXTS, convert_to_numpy=True).astype(np.float64)
    assert ((got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min() >= 0.9999


def test_decoder_reranker_equals_the_model_cards_code(tmp_path):
    """A random Qwen3ForCausalLM as wide as the Qwen2 vocabulary, saved by transformers and converted by
    `krafla convert`'s Hugging Face path, served as a reranker (pooling rank): each score is what the
    Qwen3-Reranker card's transformers code computes (prefix + tokenizer(pairs) + suffix, left padding,
    the last position's logits, log_softmax over [no, yes]) within 1e-4, so the order is the same. The
    card's tokenizer is transformers' own, over a tokenizer.json of the same vocabulary."""
    from transformers import PreTrainedTokenizerFast

    from krafla_twisted.convert.hf import convert_hf
    from krafla_twisted.engine import formats
    from tests.reference.tiny_hf import write_tiny_hf_model
    from tests.support.hf_tokenizer_json import write_hf_tokenizer
    from tests.support.testdata import vocab_gguf, vocab_mlt
    from tests.support.tiny_reranker import CARD_INSTRUCTION, CARD_PREFIX, CARD_SUFFIX, DOCUMENTS, QUERY

    mlt = vocab_mlt("qwen2")
    n_vocab = int(formats.read(mlt, formats.TOKENIZER_MAGIC).metadata["n_vocab"])
    model = write_tiny_hf_model(tmp_path / "hf", "qwen3", seed=11, vocab_size=n_vocab)
    mlb = tmp_path / "reranker.mlb"
    convert_hf(tmp_path / "hf", mlb, None, "f32", progress=False)
    folder = write_hf_tokenizer(vocab_gguf("qwen2"), tmp_path / "tokenizer", "qwen2")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>",
                                        padding_side="left")
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    prefix = tokenizer.encode(CARD_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(CARD_SUFFIX, add_special_tokens=False)

    def card_scores(instruction):
        pairs = [f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {d}" for d in DOCUMENTS]
        inputs = tokenizer(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                           max_length=256 - len(prefix) - len(suffix))
        inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
        batch = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=256)
        with torch.no_grad():
            last = model(**batch).logits[:, -1, :]
        pair = torch.nn.functional.log_softmax(torch.stack([last[:, no], last[:, yes]], dim=1), dim=1)
        return pair[:, 1].exp().tolist(), int(batch["attention_mask"].sum())

    runtime = EmbeddingRuntime.load(mlb, mlt, pooling="rank", threads=2)
    try:
        assert runtime.answer_ids == (no, yes)
        for instruction in (None, "Find the passage that names a city"):
            expected, tokens = card_scores(instruction or CARD_INSTRUCTION)
            scores, counted = runtime.rerank(QUERY, DOCUMENTS, instruction=instruction)
            np.testing.assert_allclose(scores, expected, atol=1e-4)
            assert np.argsort(scores).tolist() == np.argsort(expected).tolist()
            assert counted == tokens
            assert len(set(np.round(expected, 3))) == len(DOCUMENTS)  # distinct scores: the order means something
    finally:
        runtime.close()
