"""/v1/embeddings, /v1/rerank and Ollama's /api/embed through a real `twistd krafla --embeddings`,
driven by the clients RAG tools use: the openai library, LangChain's OpenAIEmbeddings, LlamaIndex's
OpenAILikeEmbedding and the ollama library. The vectors must equal sentence-transformers' for the
same tiny model (tests/data/embedders/expected.npz), the rerank order transformers' scores, and a
decoder reranker's (`--pooling rank`) scores the numpy reference's for the Qwen3-Reranker card's prompt.
"""

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from krafla_twisted.convert.bert import convert_bert
from tests.support.fake_backend import APIHarness
from tests.support.server import ServerProcess

DATA = Path(__file__).parent / "data" / "embedders"
EXPECTED = np.load(DATA / "expected.npz")
TEXTS = json.loads((DATA / "sentences.json").read_text())
SENTENCES = TEXTS["sentences"]
COSINE = 0.9999


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def assert_reference(vectors, reference=EXPECTED["tiny_bert_embeddings"]):
    assert len(vectors) == len(reference)
    for got, want in zip(vectors, reference):
        assert cosine(got, want) >= COSINE


def serve(tmp_path_factory, name, *extra):
    folder = tmp_path_factory.mktemp(name)
    mlb, mlt = convert_bert(DATA / name, folder / f"{name}.mlb", folder / f"{name}.mlt", "f32", progress=False)
    return ServerProcess(["--embeddings", str(mlb), "-z", str(mlt), "-t", "1", *extra]).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = serve(tmp_path_factory, "tiny-bert")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    process = serve(tmp_path_factory, "tiny-cross-encoder", "--alias", "tiny-reranker")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


class OpenAIClientTests:
    def test_strings_equal_sentence_transformers(self, client):
        """A list of strings: one vector each, in order, as SentenceTransformer.encode gives them."""
        reply = client.embeddings.create(model="tiny-bert", input=SENTENCES)
        assert [d.index for d in reply.data] == list(range(len(SENTENCES)))
        assert_reference([d.embedding for d in reply.data])
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == int(EXPECTED["tiny_bert_lengths"].sum())
        assert reply.model == "tiny-bert" and reply.object == "list"

    def test_token_ids_and_base64_give_the_same_vectors(self, client):
        """One string, its token ids, a list of token-id lists; base64 is the same floats as float32."""
        lengths = EXPECTED["tiny_bert_lengths"]
        ids = [a.tolist() for a in np.split(EXPECTED["tiny_bert_ids"], np.cumsum(lengths)[:-1])]
        text = client.embeddings.create(model="m", input=SENTENCES[0], encoding_format="float").data[0].embedding
        one = client.embeddings.create(model="m", input=ids[0]).data[0].embedding
        assert one == text
        many = client.embeddings.create(model="m", input=ids)
        assert_reference([d.embedding for d in many.data])
        raw = httpx.post(f"{client.base_url}embeddings", json={"input": SENTENCES[0], "encoding_format": "base64"},
                         timeout=60).json()["data"][0]["embedding"]
        decoded = np.frombuffer(base64.b64decode(raw), "<f4")
        np.testing.assert_array_equal(decoded, np.float32(text))
        # the openai library asks for base64 by default and decodes it itself
        assert np.allclose(client.embeddings.create(model="m", input=SENTENCES[0]).data[0].embedding, text, atol=1e-7)

    def test_dimensions_truncate_and_renormalise(self, client):
        short = client.embeddings.create(model="m", input=SENTENCES[1], dimensions=8, encoding_format="float")
        head = EXPECTED["tiny_bert_embeddings"][1][:8]
        assert len(short.data[0].embedding) == 8
        assert cosine(short.data[0].embedding, head) >= COSINE
        assert abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-6

    @pytest.mark.parametrize("body, param, words", [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "empty list"),
        ({"input": [[]]}, "input", "empty list of token ids"),
        ({"input": 5}, "input", "not a number"),
        ({"input": [1.5]}, "input", "must be a string or a list of token ids"),
        ({"input": ["ok", {"text": "x"}]}, "input", "not an object"),
        ({"input": "the " * 70}, "input", "at most 64"),
        ({"input": [[2] * 65]}, "input", "at most 64"),
        ({"input": [[2, 100000, 3]]}, "input", "outside"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "dimensions": 33}, "dimensions", "1 to 32"),
        ({"input": "a", "dimensions": 0}, "dimensions", "positive integer"),
    ])
    def test_bad_input_is_openai_400(self, server, body, param, words):
        """Each bad body gets OpenAI's 400 error shape, naming the field."""
        response = httpx.post(server.url("/embeddings"), json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert words in error["message"], error["message"]

    def test_openai_library_raises_bad_request(self, client):
        with pytest.raises(openai.BadRequestError, match="empty string"):
            client.embeddings.create(model="m", input="")

    def test_generation_endpoints_say_the_server_embeds(self, client, server):
        """A server started for embeddings answers chat and completions with a 400 that says so."""
        with pytest.raises(openai.BadRequestError, match="started for embeddings"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        response = httpx.post(server.root_url("/api/generate"), json={"model": "m", "prompt": "hi"}, timeout=60)
        assert response.status_code == 400 and "started for embeddings" in response.json()["error"]
        rerank = httpx.post(server.url("/rerank"), json={"query": "a", "documents": ["b"]}, timeout=60)
        assert rerank.status_code == 400 and rerank.json()["error"]["code"] == "model_not_reranker"


class FrameworkTests:
    def test_langchain_openai_embeddings(self, server):
        """LangChain's OpenAIEmbeddings (check_embedding_ctx_length=False sends the strings)."""
        from langchain_openai import OpenAIEmbeddings

        embeddings = OpenAIEmbeddings(model="tiny-bert", base_url=server.base_url, api_key="unused",
                                      check_embedding_ctx_length=False, max_retries=0)
        assert_reference(embeddings.embed_documents(SENTENCES))
        assert cosine(embeddings.embed_query(SENTENCES[2]), EXPECTED["tiny_bert_embeddings"][2]) >= COSINE

    def test_llama_index_openai_like_embedding(self, server):
        """LlamaIndex's OpenAILikeEmbedding, batched and one at a time."""
        from llama_index.embeddings.openai_like import OpenAILikeEmbedding

        embedding = OpenAILikeEmbedding(model_name="tiny-bert", api_base=server.base_url, api_key="unused",
                                        embed_batch_size=3)
        assert_reference(embedding.get_text_embedding_batch(SENTENCES))
        assert cosine(embedding.get_query_embedding(SENTENCES[4]), EXPECTED["tiny_bert_embeddings"][4]) >= COSINE

    def test_ollama_embed_and_legacy_embeddings(self, server):
        """The ollama library's embed (a list, one string) and its legacy embeddings call."""
        import ollama

        client = ollama.Client(host=server.root_url(""))
        reply = client.embed(model="tiny-bert", input=SENTENCES)
        assert_reference(reply.embeddings)
        assert reply.prompt_eval_count == int(EXPECTED["tiny_bert_lengths"].sum())
        single = client.embed(model="tiny-bert", input=SENTENCES[0]).embeddings
        assert len(single) == 1 and cosine(single[0], EXPECTED["tiny_bert_embeddings"][0]) >= COSINE
        legacy = client.embeddings(model="tiny-bert", prompt=SENTENCES[3]).embedding
        assert cosine(legacy, EXPECTED["tiny_bert_embeddings"][3]) >= COSINE
        with pytest.raises(ollama.ResponseError) as caught:
            client.embed(model="tiny-bert", input="")
        assert caught.value.status_code == 400


class RerankTests:
    def test_order_and_scores_equal_the_cross_encoders(self, reranker):
        """Results best first, each document's score transformers' logit; top_n and return_documents."""
        body = {"model": "tiny-reranker", "query": TEXTS["query"], "documents": TEXTS["documents"]}
        reply = httpx.post(reranker.url("/rerank"), json=body, timeout=60).json()
        order = np.argsort(-EXPECTED["cross_scores"], kind="stable").tolist()
        assert [r["index"] for r in reply["results"]] == order
        for result in reply["results"]:
            assert abs(result["relevance_score"] - EXPECTED["cross_scores"][result["index"]]) < 1e-4
            assert "document" not in result
        assert reply["usage"]["prompt_tokens"] == int(EXPECTED["cross_lengths"].sum())
        top = httpx.post(reranker.root_url("/rerank"), json={**body, "top_n": 2, "return_documents": True,
                                                            "documents": [{"text": d} for d in TEXTS["documents"]]},
                         timeout=60).json()["results"]
        assert [r["index"] for r in top] == order[:2]
        assert [r["document"]["text"] for r in top] == [TEXTS["documents"][i] for i in order[:2]]

    @pytest.mark.parametrize("body, param", [
        ({"documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [3]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a " * 70]}, "documents"),
        ({"query": "q", "documents": ["a"], "instruction": "x"}, "instruction"),  # a decoder reranker's field
    ])
    def test_bad_rerank_bodies_are_400(self, reranker, body, param):
        response = httpx.post(reranker.url("/rerank"), json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def decoder_reranker(tmp_path_factory):
    """`twistd krafla --pooling rank` on the tiny random qwen3 reranker (tests/support/tiny_reranker.py),
    with the numpy reference and Hugging Face's tokenizers for the same vocabulary."""
    from tests.support.reference import ReferenceModel
    from tests.support.tiny_reranker import reranker_files

    mlb, mlt, hf = reranker_files(tmp_path_factory.mktemp("decoder-reranker"))
    process = ServerProcess(["--pooling", "rank", str(mlb), "-z", str(mlt), "-t", "1", "--alias", "tiny-judge"]).start()
    process.reference, process.hf = ReferenceModel(mlb), hf
    yield process
    process.stop()


class DecoderRerankServerTests:
    def test_order_and_scores_equal_the_reference(self, decoder_reranker):
        """/v1/rerank on a decoder reranker: best first, each score the numpy forward pass's p(yes)
        for the card's prompt (the default instruction, then the request's)."""
        from tests.support.tiny_reranker import CARD_INSTRUCTION, DOCUMENTS, QUERY, card_prompt, reference_score

        server, hf = decoder_reranker, decoder_reranker.hf
        assert any("decoder reranker" in line for line in server.lines)
        no, yes = hf.token_to_id("no"), hf.token_to_id("yes")
        for instruction in (None, "Find the passage that names a city"):
            body = {"model": "tiny-judge", "query": QUERY, "documents": DOCUMENTS, "return_documents": True}
            if instruction:
                body["instruction"] = instruction
            reply = httpx.post(server.url("/rerank"), json=body, timeout=120).json()
            prompts = [card_prompt(hf, instruction or CARD_INSTRUCTION, QUERY, d) for d in DOCUMENTS]
            expected = [reference_score(server.reference, ids, no, yes) for ids in prompts]
            assert [r["index"] for r in reply["results"]] == np.argsort(expected)[::-1].tolist()
            for result in reply["results"]:
                assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4
                assert result["document"]["text"] == DOCUMENTS[result["index"]]
            assert reply["model"] == "tiny-judge" and reply["usage"]["prompt_tokens"] == sum(map(len, prompts))

    @pytest.mark.parametrize("path, body, param, words", [
        ("/rerank", {"query": "q", "documents": ["d"], "instruction": 3}, "instruction", "non-empty string"),
        ("/rerank", {"query": "q", "documents": ["d", "word " * 600]}, "documents", "at most 512"),
        ("/embeddings", {"input": "a sentence"}, "model", "reranker"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "it answers /v1/rerank,"),
    ])
    def test_bad_requests_are_400(self, decoder_reranker, path, body, param, words):
        """A bad instruction, a prompt past the context, embeddings of a reranker: 400 naming the field."""
        response = httpx.post(decoder_reranker.url(path), json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error


class PoolingOptionTests:
    def test_pooling_rank_implies_embeddings_and_needs_a_model(self, tmp_path):
        """`--pooling rank MODEL` serves embeddings without --embeddings; without a model file, or with a
        pooling krafla does not have, the start stops with a message."""
        from twisted.python import usage

        from krafla_twisted.tap import Options

        mlb, mlt = tmp_path / "judge.mlb", tmp_path / "judge.mlt"
        mlb.write_bytes(b"")
        mlt.write_bytes(b"")
        options = Options()
        options.parseOptions(["--pooling", "rank", str(mlb), "-z", str(mlt)])
        assert options["embeddings"] and options["pooling"] == "rank"
        with pytest.raises(usage.UsageError, match="needs the reranker's model file"):
            Options().parseOptions(["--pooling", "rank"])
        with pytest.raises(usage.UsageError, match="mean, cls, last or rank"):
            Options().parseOptions(["--embeddings", "--pooling", "max", str(mlb), "-z", str(mlt)])


class ChatServerTests:
    def test_a_chat_server_refuses_embeddings_clearly(self):
        """A server not started for embeddings answers /v1/embeddings, /v1/rerank and /api/embed with 400."""
        harness = APIHarness()
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]})):
            response, content = harness.fetch("POST", path, body)
            assert response.code == 400
            error = json.loads(content)["error"]
            assert error["code"] == "model_not_embedding" and "--embeddings" in error["message"]
        response, content = harness.fetch("POST", "/api/embed", {"model": "m", "input": "hi"})
        assert response.code == 400 and "not started for embeddings" in json.loads(content)["error"]


class RealMiniLMServerTests:
    def test_default_embedding_model_equals_sentence_transformers(self):
        """`twistd krafla --embeddings` without a model serves all-MiniLM-L6-v2 (pulled into the shared
        cache): the openai client and LangChain get SentenceTransformer.encode's vectors
        (tests/data/embedders/minilm_expected.npz); Ollama's /api/show says it embeds."""
        from langchain_openai import OpenAIEmbeddings

        from krafla_twisted.cli import models
        models.pull_embedder(models.DEFAULT_EMBEDDER, progress=False)  # the pull's lock, before the server's
        reference = np.load(DATA / "minilm_expected.npz")["embeddings"]
        process = ServerProcess(["--embeddings", "-t", "2"]).start()
        try:
            client = openai.OpenAI(base_url=process.base_url, api_key="unused", max_retries=0)
            reply = client.embeddings.create(model="all-MiniLM-L6-v2", input=SENTENCES)
            assert_reference([d.embedding for d in reply.data], reference)
            assert reply.model == "all-MiniLM-L6-v2-F16"
            langchain = OpenAIEmbeddings(model="m", base_url=process.base_url, api_key="unused",
                                         check_embedding_ctx_length=False, max_retries=0)
            assert_reference(langchain.embed_documents(SENTENCES), reference)
            show = httpx.post(process.root_url("/api/show"), json={"model": "m"}, timeout=60).json()
            assert show["capabilities"] == ["embedding"]
            too_long = httpx.post(process.url("/embeddings"), json={"input": "word " * 600}, timeout=60)
            assert too_long.status_code == 400 and "at most 512" in too_long.json()["error"]["message"]
        finally:
            process.stop()


class RealNomicServerTests:
    def test_nomic_embed_text_through_v1_embeddings(self):
        """nomic-embed-text-v1.5 (pulled into the shared cache) served with --embeddings: the openai
        client's vectors of prefixed texts equal the numpy forward pass of its GGUF
        (tests/test_embeddings.py), the query is nearest its document, and `dimensions` keeps the
        reference's first values renormalised (the model is trained for 768 down to 64)."""
        from krafla_twisted.cli import models
        from krafla_twisted.engine.wordpiece import WordPiece
        from tests.test_embeddings import NOMIC_DOCUMENTS, NOMIC_QUERY, mean_normalised, nomic_reference

        pulled = models.pull_embedder("nomic-embed-text-v1.5", progress=False)
        texts = [NOMIC_QUERY, *NOMIC_DOCUMENTS]
        ids = [WordPiece(pulled.mlt).encode(t) for t in texts[:2]]
        source = pulled.mlb.parent / "nomic-embed-text-v1.5.f16.gguf"
        reference = [mean_normalised(states) for states in nomic_reference(source, ids)]
        process = ServerProcess(["--embeddings", str(pulled.mlb), "-z", str(pulled.mlt), "-t", "2"]).start()
        try:
            client = openai.OpenAI(base_url=process.base_url, api_key="unused", max_retries=0)
            reply = client.embeddings.create(model="nomic-embed-text-v1.5", input=texts, encoding_format="float")
            vectors = [d.embedding for d in reply.data]
            assert reply.model == "nomic-embed-text-v1.5-F16" and len(vectors[0]) == 768
            assert_reference(vectors[:2], reference)
            similarity = [float(np.dot(vectors[0], v)) for v in vectors[1:]]
            assert similarity[0] > max(similarity[1:]) + 0.2, similarity
            short = client.embeddings.create(model="m", input=texts[:2], dimensions=256, encoding_format="float")
            assert_reference([d.embedding for d in short.data], [r[:256] / np.linalg.norm(r[:256]) for r in reference])
        finally:
            process.stop()
