"""Whether an llguidance grammar accepts a text, over a vocabulary of the 256 bytes: a grammar's
language checked without any model's tokenizer in the way (tests/test_tools.py, tests/test_gbnf.py)."""

import llguidance


class _Bytes:
    """The 256 bytes and an end token (256)."""

    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<end>"]

    def __call__(self, data):
        return list(bytes(data))


_TOKENIZER = None


def accepts(grammar_text, text):
    """Whether `grammar_text` (Lark, or llguidance's grammar from grammar.lark_grammar) accepts `text`
    whole: every byte continues it and it may end after the last."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)
    matcher = llguidance.LLMatcher(_TOKENIZER, grammar_text, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for byte in text.encode("utf-8"):
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()
