"""Embeddings and reranking: an encoder model (or a decoder embedder), its tokenizer, pooled as its card says.

    runtime = EmbeddingRuntime.load("all-MiniLM-L6-v2-F16.mlb", "all-MiniLM-L6-v2.mlt", threads=2)
    vectors = runtime.embed([runtime.tokenize("a sentence"), [101, 2088, 102]])   # lists of floats
    scores = reranker.rerank("a query", ["doc one", "doc two"])                   # one float per document

The pooling is the file's (`pooling`: the sentence-transformers Pooling module the converter
read; convert/bert.py) unless the server's --pooling says otherwise; the vector is L2-normalised
when the file says `normalize` (a Normalize module followed). `dimensions` keeps the first N
values and normalises again (Matryoshka truncation; a model not trained for it gives vectors that
are merely shorter). A decoder (llama, qwen3, ...: Qwen3-Embedding is a qwen3) is pooled by its
last token (`--pooling mean` for a mean-pooled one) and normalised, over the states after its
final norm. A reranker (a cross-encoder: n_labels > 0) scores "[CLS] query [SEP]
document [SEP]" by its classifier's first output, the raw logit as llama-server gives it (the
sigmoid of sentence-transformers' CrossEncoder is monotonic: the order is the same).

A decoder loaded with pooling "rank" is a Qwen3-Reranker-style reranker: each document is put in
that model card's prompt (its system message, "<Instruct>: ...\n<Query>: ...\n<Document>: ...",
an assistant turn opened with an empty think block) and scored by the probability of "yes"
against "no" as the next token: softmax over the two logits, the "yes" share. The prompt's
markers are special tokens; the instruction, query and document are plain text, as a chat
template's messages are (chat/templates.py).

Everything here runs on the engine worker's thread.
"""

import array
import math

POOLINGS = ("mean", "cls", "last", "rank")

# The Qwen3-Reranker model card's prompt (Qwen/Qwen3-Reranker-0.6B, "Transformers Usage").
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class EmbeddingError(ValueError):
    """A request the model cannot answer: the message says what and why (the API's 400)."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


class EmbeddingRuntime:
    """An encoder Model with its Encoder and WordPiece tokenizer. Owns all three (close())."""

    def __init__(self, model, tokenizer, *, pooling=None, threads=1):
        from krafla_twisted.engine.embedding import Encoder

        self.model = model
        self.tokenizer = tokenizer
        self.encoder = Encoder(model)
        self.threads = threads
        # An encoder's file says how (convert/bert.py); a decoder embedder is Qwen3-Embedding's
        # kind: its last token, normalised.
        default = model.info.get("pooling", "mean") if self.encoder.is_encoder else "last"
        self.pooling = pooling or default
        if self.pooling not in POOLINGS:
            raise EmbeddingError(f"pooling {self.pooling!r} is not one of {', '.join(POOLINGS)}")
        self.normalize = bool(model.info.get("normalize", 0 if self.encoder.is_encoder else 1))
        self.dim = self.encoder.dim
        self.n_labels = self.encoder.n_labels
        self.max_tokens = self.encoder.max_tokens
        self.n_vocab = model.n_vocab
        self.answer_ids = None  # a decoder reranker's ("no", "yes") token ids
        if self.pooling == "rank" and self.encoder.is_encoder and not self.n_labels:
            raise EmbeddingError("pooling 'rank' needs a reranker, and this encoder has no classifier head")
        if self.pooling == "rank" and not self.encoder.is_encoder:
            self.answer_ids = tokenizer.answer_ids()

    @classmethod
    def load(cls, model_path, tokenizer_path, *, threads=1, pooling=None):
        """Open the .mlb and its .mlt (WordPiece for an encoder, the C tokenizer's BPE or
        SentencePiece for a decoder); clib.KraflaError / ValueError for a bad file."""
        from krafla_twisted.engine import formats
        from krafla_twisted.engine.model import Model
        from krafla_twisted.engine.tokenizer import Tokenizer
        from krafla_twisted.engine.wordpiece import WordPiece

        kind = formats.read(tokenizer_path, formats.TOKENIZER_MAGIC).metadata.get("kind")
        tokenizer = WordPiece(tokenizer_path) if kind == "wordpiece" else _DecoderTokenizer(Tokenizer(tokenizer_path))
        model = Model(model_path, threads=threads)
        try:
            runtime = cls(model, tokenizer, pooling=pooling, threads=threads)
        except BaseException:
            model.close()
            raise
        if tokenizer.n_vocab != model.n_vocab:
            runtime.close()
            raise EmbeddingError(f"{tokenizer_path}: {tokenizer.n_vocab} tokens, but {model_path} has {model.n_vocab}")
        return runtime

    @property
    def is_reranker(self):
        return self.n_labels > 0 or self.answer_ids is not None

    @property
    def isa(self):
        from krafla_twisted.engine.model import library_isa

        return library_isa()

    def tokenize(self, text):
        """[CLS] text [SEP] as ids."""
        return self.tokenizer.encode(text)

    def check_length(self, ids, index, param="input"):
        if not ids:
            raise EmbeddingError(f"'{param}'[{index}] is empty", param=param)
        if len(ids) > self.max_tokens:
            raise EmbeddingError(f"'{param}'[{index}] is {len(ids)} tokens; this model takes at most "
                                 f"{self.max_tokens}", param=param)
        for token in ids:
            if not 0 <= token < self.n_vocab:
                raise EmbeddingError(f"'{param}'[{index}] holds token id {token}, outside [0, {self.n_vocab})",
                                     param=param)

    def embed(self, sequences, dimensions=None):
        """One list of floats per sequence of token ids, pooled and normalised as the model says,
        then cut to `dimensions` (and normalised again) when given."""
        if self.pooling == "rank":
            raise EmbeddingError("this model was loaded as a reranker (pooling rank): it answers /v1/rerank, not "
                                 "embeddings", param="model")
        if dimensions is not None and not 1 <= dimensions <= self.dim:
            raise EmbeddingError(f"'dimensions' is {dimensions}; this model gives 1 to {self.dim}", param="dimensions")
        for index, ids in enumerate(sequences):
            self.check_length(ids, index)
        rows = self.encoder.embed(sequences, self.pooling)
        vectors = []
        for row in rows:
            values = list(row)
            if self.normalize:
                values = _normalized(values)
            if dimensions is not None and dimensions < self.dim:
                values = _normalized(values[:dimensions])
            vectors.append(array.array("f", values).tolist())  # float32 values: base64 and JSON agree
        return vectors

    def rerank(self, query, documents, instruction=None):
        """(scores, tokens): the classifier's first output for each (query, document) pair (a
        decoder reranker: the probability of "yes", with `instruction` or the card's default in its
        prompt), and how many tokens the pairs held."""
        if not self.is_reranker:
            raise EmbeddingError("this model is not a reranker (it has no classifier head)", param="model")
        if self.answer_ids is not None:
            return self._judge(query, documents, RERANK_INSTRUCTION if instruction is None else instruction)
        if instruction is not None:
            raise EmbeddingError("'instruction' goes to a decoder reranker's prompt; this cross-encoder reads the "
                                 "query and the documents only", param="instruction")
        pairs, types = [], []
        for index, document in enumerate(documents):
            ids, segment = self.tokenizer.encode_pair(query, document)
            if len(ids) > self.max_tokens:
                raise EmbeddingError(f"the query with 'documents'[{index}] is {len(ids)} tokens; this model takes "
                                     f"at most {self.max_tokens}", param="documents")
            pairs.append(ids)
            types.append(segment)
        rows = self.encoder.embed(pairs, "rank", token_types=types)
        return [float(row[0]) for row in rows], sum(len(p) for p in pairs)

    def _judge(self, query, documents, instruction):
        prompts = []
        for index, document in enumerate(documents):
            ids = self.tokenizer.encode_judged(instruction, query, document)
            if len(ids) > self.max_tokens:
                raise EmbeddingError(f"the prompt of 'documents'[{index}] is {len(ids)} tokens; this model takes at "
                                     f"most {self.max_tokens}", param="documents")
            prompts.append(ids)
        rows = self.encoder.last_logits(prompts, pick=self.answer_ids)
        return [_yes_probability(no, yes) for no, yes in rows], sum(len(p) for p in prompts)

    def close(self):
        self.encoder.close()
        self.model.close()


class _DecoderTokenizer:
    """The C tokenizer of a decoder embedder with WordPiece's `encode`: the text's ids, with the
    bos/eos the file says to add (Qwen3-Embedding's tokenizer appends its <|endoftext|>)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.n_vocab = tokenizer.n_vocab

    def encode(self, text):
        return list(self.tokenizer.encode(text))

    def encode_pair(self, first, second):
        raise EmbeddingError("a decoder model is not a reranker", param="model")

    def encode_judged(self, instruction, query, document):
        """A decoder reranker's prompt for one document, as the Qwen3-Reranker card builds it: the
        prefix, the "<Instruct>/<Query>/<Document>" text and the suffix, each encoded alone, none
        with a bos or eos."""
        text = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        encode = self.tokenizer.encode
        return (encode(RERANK_PREFIX, add_bos=False, add_eos=False, special=True)
                + encode(text, add_bos=False, add_eos=False)
                + encode(RERANK_SUFFIX, add_bos=False, add_eos=False, special=True))

    def answer_ids(self):
        """The ids of the vocabulary entries spelled "no" and "yes" (the two answers a decoder
        reranker's score weighs), or EmbeddingError when the vocabulary lacks one."""
        ids = tuple(self.tokenizer.token_id(word) for word in ("no", "yes"))
        if None in ids:
            raise EmbeddingError(f"{self.tokenizer.path}: no token spelled 'yes' and 'no' in the vocabulary; pooling "
                                 "'rank' on a decoder scores the answer 'yes' (a Qwen3-Reranker-style model)")
        return ids


def _yes_probability(no, yes):
    """softmax([no, yes])[1], without overflow for logits far apart."""
    margin = float(no) - float(yes)
    if margin > 0:
        odds = math.exp(-margin)
        return odds / (1.0 + odds)
    return 1.0 / (1.0 + math.exp(margin))


def _normalized(values):
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else values
