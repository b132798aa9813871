"""Embeddings and reranking over HTTP: OpenAI's /v1/embeddings, the Jina/Cohere /v1/rerank that
llama-server serves, and Ollama's /api/embed and /api/embeddings.

    POST /v1/embeddings {"input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...],
                         "encoding_format": "float" | "base64", "dimensions": N, "model": ...}
      -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
          "model": ID, "usage": {"prompt_tokens": N, "total_tokens": N}}
    POST /v1/rerank {"query": "...", "documents": ["...", {"text": "..."}], "top_n": N,
                     "return_documents": false, "instruction": "..." (a decoder reranker's)}
      -> {"object": "list", "model": ID, "usage": {...},
          "results": [{"index": 2, "relevance_score": 3.1, "document": {"text": "..."}}, ...]}  (best first)
    POST /api/embed {"model": ..., "input": "text" | ["text", ...], "dimensions": N}
      -> {"model": ..., "embeddings": [[...]], "total_duration": ns, "load_duration": 0, "prompt_eval_count": N}
    POST /api/embeddings {"model": ..., "prompt": "text"} -> {"embedding": [...]}

The server answers them when it was started for embeddings (`twistd krafla --embeddings`, with an
encoder model, or `--pooling rank` with a decoder reranker: api.backend.embeddings is a
generation.embeddings.EmbeddingRuntime); a chat server
answers 400 `model_not_embedding`. A server started for embeddings answers the completion
endpoints 400 likewise (routes.py). Tokenizing and the forward pass run as one job on the engine
worker, inside --max-queue, like a completion.
"""

import base64
import struct
import time

from twisted.web.server import NOT_DONE_YET

from krafla_twisted.api.errors import InvalidRequest
from krafla_twisted.api.resources import Endpoint, QueuedReply
from krafla_twisted.api.schema import json_type, parse_json_body
from krafla_twisted.generation.embeddings import EmbeddingError

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
MAX_DOCUMENTS = 4096


def not_started_for(what):
    return InvalidRequest(
        f"This model was not started for {what}: start the server with an embedding model and --embeddings "
        "(twistd krafla --embeddings MODEL.mlb -z TOKENIZER.mlt)", param="model", code="model_not_embedding")


def embedding_runtime(backend, what="embeddings"):
    """The backend's EmbeddingRuntime, or the 400 that says the server was not started for it."""
    runtime = getattr(backend, "embeddings", None)
    if runtime is None:
        raise not_started_for(what)
    return runtime


def _is_id(value):
    return isinstance(value, int) and not isinstance(value, bool)


def parse_input(value, param="input"):
    """OpenAI's `input` as a list of items, each a string or a list of token ids."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise InvalidRequest(f"'{param}' is an empty list; send at least one string", param=param)
    else:
        raise InvalidRequest(f"'{param}' must be a string, a list of strings, a list of token ids or a list of "
                             f"lists of token ids, not {json_type(value)}", param=param)
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(f"'{param}' holds {len(items)} inputs; at most {MAX_INPUTS}", param=param)
    for index, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"'{param}'[{index}] is an empty string", param=param)
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"'{param}'[{index}] holds a lone UTF-16 surrogate", param=param) from None
        elif isinstance(item, list):
            if not item:
                raise InvalidRequest(f"'{param}'[{index}] is an empty list of token ids", param=param)
            if not all(_is_id(v) for v in item):
                raise InvalidRequest(f"'{param}'[{index}] must hold only integer token ids", param=param)
        else:
            raise InvalidRequest(f"'{param}'[{index}] must be a string or a list of token ids, not "
                                 f"{json_type(item)}", param=param)
    return items


def parse_dimensions(body):
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_id(dimensions) or dimensions < 1):
        raise InvalidRequest(f"'dimensions' must be a positive integer, not {dimensions!r}", param="dimensions")
    return dimensions


def embed_items(runtime, items, dimensions):
    """Worker thread: (vectors, prompt tokens) of strings and token-id lists; EmbeddingError -> 400."""
    sequences = [runtime.tokenize(item) if isinstance(item, str) else item for item in items]
    try:
        vectors = runtime.embed(sequences, dimensions=dimensions)
    except EmbeddingError as e:
        raise InvalidRequest(str(e), param=e.param) from None
    return vectors, sum(len(s) for s in sequences)


def encode_base64(vector):
    """OpenAI's base64 encoding: the little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class Embeddings(Endpoint):
    """POST /v1/embeddings."""

    methods = ("POST",)

    def render_POST(self, request):
        body = parse_json_body(request.content.read())
        items = parse_input(body.get("input"))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise InvalidRequest(f"'encoding_format' must be 'float' or 'base64', not {encoding!r}",
                                 param="encoding_format")
        dimensions = parse_dimensions(body)
        embedding_runtime(self.api.backend)
        self.api.admit()
        model_id = self.api.backend.model_id

        def work(backend, cancelled):
            vectors, tokens = embed_items(embedding_runtime(backend), items, dimensions)
            data = [{"object": "embedding", "index": i,
                     "embedding": encode_base64(v) if encoding == "base64" else v} for i, v in enumerate(vectors)]
            return {"object": "list", "data": data, "model": model_id,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        QueuedReply(self.api, request, work).start()
        return NOT_DONE_YET


def parse_rerank(body):
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise InvalidRequest("'query' is required and must be a non-empty string", param="query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise InvalidRequest("'documents' is required and must be a non-empty list of strings", param="documents")
    if len(documents) > MAX_DOCUMENTS:
        raise InvalidRequest(f"'documents' holds {len(documents)} documents; at most {MAX_DOCUMENTS}", param="documents")
    texts = []
    for index, document in enumerate(documents):
        if isinstance(document, dict) and isinstance(document.get("text"), str):
            document = document["text"]
        if not isinstance(document, str):
            raise InvalidRequest(f"'documents'[{index}] must be a string or {{\"text\": string}}, not "
                                 f"{json_type(document)}", param="documents")
        texts.append(document)
    top_n = body.get("top_n", len(texts))
    if not _is_id(top_n) or top_n < 1:
        raise InvalidRequest(f"'top_n' must be a positive integer, not {top_n!r}", param="top_n")
    return_documents = body.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise InvalidRequest("'return_documents' must be a boolean", param="return_documents")
    instruction = body.get("instruction")
    if instruction is not None and (not isinstance(instruction, str) or not instruction):
        raise InvalidRequest("'instruction' must be a non-empty string", param="instruction")
    return query, texts, top_n, return_documents, instruction


class Rerank(Endpoint):
    """POST /v1/rerank (and /rerank, /v1/reranking as llama-server has them)."""

    methods = ("POST",)

    def render_POST(self, request):
        query, texts, top_n, return_documents, instruction = parse_rerank(parse_json_body(request.content.read()))
        runtime = embedding_runtime(self.api.backend, "reranking")
        if not runtime.is_reranker:
            raise InvalidRequest("This model is an embedding model, not a reranker: /v1/rerank needs a "
                                 "cross-encoder (a BertForSequenceClassification) or a decoder reranker served "
                                 "with --pooling rank", param="model", code="model_not_reranker")
        self.api.admit()
        model_id = self.api.backend.model_id

        def work(backend, cancelled):
            try:
                scores, tokens = embedding_runtime(backend, "reranking").rerank(query, texts, instruction)
            except EmbeddingError as e:
                raise InvalidRequest(str(e), param=e.param) from None
            order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))[:top_n]
            results = []
            for i in order:
                result = {"index": i, "relevance_score": scores[i]}
                if return_documents:
                    result["document"] = {"text": texts[i]}
                results.append(result)
            return {"object": "list", "model": model_id, "results": results,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        QueuedReply(self.api, request, work).start()
        return NOT_DONE_YET


# --- Ollama's shapes (mounted by api/ollama.py, which gives them its error shape)


def ollama_embed_work(body, legacy, model_id):
    """The worker's job for POST /api/embed (legacy False) or /api/embeddings (legacy True)."""
    if legacy:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' is required and must be a string", param="prompt")
        items = [prompt] if prompt else []
        dimensions = None
    else:
        items = parse_input(body.get("input"))
        if any(not isinstance(item, str) for item in items):
            raise InvalidRequest("'input' must be a string or a list of strings", param="input")
        dimensions = parse_dimensions(body)
    started = time.monotonic()

    def work(backend, cancelled):
        runtime = embedding_runtime(backend)
        if not items:  # Ollama answers an empty legacy prompt with an empty embedding
            return {"embedding": []}
        vectors, tokens = embed_items(runtime, items, dimensions)
        if legacy:
            return {"embedding": vectors[0]}
        return {"model": body.get("model") or model_id, "embeddings": vectors,
                "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
                "prompt_eval_count": tokens}

    return work


class EmbeddingsOnly(Endpoint):
    """What a server started for embeddings answers on the generation endpoints: a 400 that says so."""

    methods = ("GET", "POST")

    def dispatch(self, request):
        runtime = self.api.backend.embeddings
        if runtime.pooling == "rank":
            answers = "/v1/rerank"
        else:
            answers = "/v1/embeddings" + (" and /v1/rerank" if runtime.is_reranker else "")
        raise InvalidRequest(f"This server was started for embeddings (--embeddings): it answers {answers}, not text "
                             "generation; start another server for a chat model", param="model", code="model_not_chat")


class EmbeddingBackend:
    """What the API serves when the server was started with --embeddings: an EmbeddingRuntime
    (`embeddings`) and no text generation (no scheduler, no chat template)."""

    scheduler = None
    template = None
    has_chat = False

    def __init__(self, runtime, *, model_id):
        self.embeddings = runtime
        self.runtime = runtime        # api/ollama.py's model facts read runtime.model
        self.model_id = model_id
        self.n_ctx = runtime.max_tokens
        self.n_vocab = runtime.n_vocab

    def banner(self):
        """`# krafla 0.7.0, isa avx2: embedding model NAME, dim 384, pooling mean, normalized, max 512 tokens, threads N`."""
        from krafla_twisted import __version__

        runtime = self.embeddings
        if runtime.n_labels:
            kind = f"reranker, {runtime.n_labels} label(s)"
        elif runtime.is_reranker:
            kind = "decoder reranker, the probability of 'yes'"
        else:
            kind = f"dim {runtime.dim}, pooling {runtime.pooling}, {'normalized' if runtime.normalize else 'not normalized'}"
        return (f"# krafla {__version__}, isa {runtime.isa}: embedding model {self.model_id}, {kind}, "
                f"max {runtime.max_tokens} tokens, threads {runtime.threads}")
