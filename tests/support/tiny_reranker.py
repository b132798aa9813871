"""A tiny random decoder reranker (Qwen3-Reranker style) and what an independent reference says of it.

`write_tiny_reranker(path, n_vocab)` writes a random qwen3 .mlb (tests/support/tiny_models.py) as wide as
the Qwen2 vocabulary of llama.cpp's test vectors, so that the real tokenizer's prompt fits it;
`card_prompt(tokenizer, instruction, query, document)` builds the prompt as the Qwen3-Reranker model
card's Python does (its strings spelled here, from the card), with Hugging Face's `tokenizers` on a
tokenizer.json of that vocabulary; `reference_score(model, ids, no_id, yes_id)` is the numpy forward
pass's softmax over the logits of "no" and "yes" at the last position, the "yes" share.
"""

import math

from tests.support.hf_tokenizer_json import write_hf_tokenizer
from tests.support.testdata import vocab_gguf, vocab_mlt
from tests.support.tiny_models import write_tiny_model

VOCAB = "qwen2"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
               "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
               "<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "The lazy dog sleeps.", "France has a city named Paris.",
             "A cat is on the mat", "The capital of France is Paris, on the Seine."]


def reranker_files(folder, seed=7):
    """(mlb, mlt, hf_tokenizer): the tiny model, krafla's .mlt of the Qwen2 vocabulary, and that
    vocabulary as a `tokenizers.Tokenizer` read from the tokenizer.json written for it."""
    from tokenizers import Tokenizer

    from krafla_twisted.engine import formats

    mlt = vocab_mlt(VOCAB)
    n_vocab = int(formats.read(mlt, formats.TOKENIZER_MAGIC).metadata["n_vocab"])
    mlb = folder / "tiny-reranker.mlb"
    write_tiny_model(mlb, "qwen3", seed=seed, n_vocab=n_vocab, max_seq=512)
    hf = Tokenizer.from_file(str(write_hf_tokenizer(vocab_gguf(VOCAB), folder / "hf", VOCAB) / "tokenizer.json"))
    return mlb, mlt, hf


def card_prompt(tokenizer, instruction, query, document):
    """The model card's process_inputs for one pair: prefix + the pair's tokens + suffix (Qwen's
    tokenizer adds no bos or eos)."""
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    return [t for text in (CARD_PREFIX, pair, CARD_SUFFIX) for t in tokenizer.encode(text, add_special_tokens=False).ids]


def reference_score(model, ids, no_id, yes_id):
    """The card's compute_logits for one prompt: exp(log_softmax([no, yes])[1])."""
    logits = model.last_logits(ids)
    no, yes = float(logits[no_id]), float(logits[yes_id])
    top = max(no, yes)
    return math.exp(yes - top) / (math.exp(no - top) + math.exp(yes - top))
