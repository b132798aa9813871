"""A tiny SentencePiece vocabulary written into a GGUF, for the tests that build GGUFs by hand
(bench/moe_model.py's upcycling, bench/dense_model.py): llama.cpp's tokenizer.ggml.* keys, every
token normal but <unk> (unknown) and <s>, </s> (control), scores falling with the id."""

TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "d", "\u2581a", "\u2581b", "\u2581c", "\u2581d"]


def add_tokenizer(writer):
    """TOKENS as the GGUF writer's tokenizer (model "llama"), ids 0, 1, 2 unknown, BOS and EOS."""
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", TOKENS)
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.0, 0.0] + [-float(i) for i in range(1, len(TOKENS) - 2)])
    writer.add_array("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
