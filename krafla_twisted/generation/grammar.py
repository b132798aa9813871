"""Constrained sampling: a grammar keeps every sampled token a valid prefix of what it allows.

The grammar engine is llguidance (docs/api.md says why it and not xgrammar). A `Constraint` holds
one llguidance matcher for one reply:

    vocabulary = Vocabulary.of(tokenizer, stop_token_ids)   # built once per tokenizer (~0.2 s)
    constraint = Constraint(vocabulary, json_schema_grammar({"type": "object"}))
    constraint.mask(logits)        # tokens the grammar forbids become -inf (in place)
    constraint.accept(token)       # the sampled token moves the matcher on
    constraint.done                # the value is complete: nothing but the end may follow

Everything here runs in the worker thread; a Vocabulary may be shared by the matchers of any
number of requests. Grammars are bounded by llguidance's parser limits (LIMITS): a schema that
would need more is refused with GrammarError (a 400), and no step of a matcher can run long.
"""

import ctypes
import json
import threading
import weakref

from krafla_twisted.engine import sampler

# JSON in replies is written on one line as Python's json.dumps writes it ({"a": 1, "b": [2]}):
# flexible whitespace lets a small model pad a value with newlines until max_tokens, and this is
# the spelling chat templates use for tool arguments (so a call renders back as it was written).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that cannot constrain a reply: invalid, unsupported or too large.
    The message names the feature or the limit."""


def _llguidance():
    import llguidance

    return llguidance


def limits():
    """llguidance's parser limits for one request: grammar construction and every mask step stay
    within a few hundred milliseconds even for hostile schemas (the defaults allow more)."""
    llguidance = _llguidance()
    return llguidance.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     step_max_items=50_000, max_lexer_states=100_000, max_grammar_size=200_000,
                                     verbose_errors=False)


def json_schema_grammar(schema):
    """The llguidance grammar of replies that are one JSON value valid against `schema` (a dict)."""
    llguidance = _llguidance()
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be used: {e}") from None


def lark_grammar(text):
    """The llguidance grammar of a Lark-syntax grammar text (may hold `%json {...}` rules)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def json_rule(schema):
    """A Lark rule body that matches one JSON value valid against `schema`, written compactly."""
    schema = dict(schema)
    guidance = dict(schema.get("x-guidance") or {})
    guidance.update(JSON_OPTIONS)
    schema["x-guidance"] = guidance
    return "%json " + json.dumps(schema)


class Vocabulary:
    """llguidance's view of one tokenizer: each token's bytes (control tokens marked special, so
    no text in a grammar can produce them) and the token that ends a reply."""

    _cache = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer, stop_token_ids):
        llguidance = _llguidance()
        self.n_vocab = tokenizer.n_vocab
        self.stop_token_ids = tuple(sorted(int(t) for t in stop_token_ids))
        if not self.stop_token_ids:
            raise GrammarError("this model has no end-of-reply token, so a constrained reply could not end")
        tokens = []
        special = []
        for token in range(tokenizer.n_vocab):
            piece = tokenizer.token_bytes(token)
            if tokenizer.is_control(token):
                # llguidance's mark for a special token: a grammar's text never matches it.
                piece = b"\xff" + piece
                special.append(token)
            tokens.append(piece)
        end = self.stop_token_ids[0]

        class Wrapped:
            eos_token_id = end
            bos_token_id = tokenizer.bos_id
            special_token_ids = special

            def __call__(self, text):
                return tokenizer.encode(bytes(text), add_bos=False, special=False)

        Wrapped.tokens = tokens
        self.end_token = end
        self.lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=self.n_vocab)

    @classmethod
    def of(cls, tokenizer, stop_token_ids):
        """The Vocabulary of `tokenizer` with these stop tokens, built on first use and kept while
        the tokenizer lives."""
        key = frozenset(int(t) for t in stop_token_ids)
        with cls._lock:
            per_tokenizer = cls._cache.setdefault(tokenizer, {})
            if key not in per_tokenizer:
                per_tokenizer[key] = cls(tokenizer, key)
            return per_tokenizer[key]


class Constraint:
    """One reply's grammar state. `mask` before sampling, `accept` after; `done` when complete."""

    def __init__(self, vocabulary, grammar):
        llguidance = _llguidance()
        self.vocabulary = vocabulary
        error = llguidance.LLMatcher.validate_grammar(grammar, vocabulary.lltokenizer, limits=limits())
        if error and not error.startswith("WARNING"):
            raise GrammarError(_readable(error))
        self.matcher = llguidance.LLMatcher(vocabulary.lltokenizer, grammar, log_level=0, limits=limits())
        if self.matcher.is_error():
            raise GrammarError(_readable(self.matcher.get_error()))
        words = (vocabulary.n_vocab + 31) // 32
        self._bits = (ctypes.c_uint32 * words)()

    @property
    def done(self):
        """The value is complete and nothing may follow it."""
        return self.matcher.is_stopped()

    def allowed_bits(self):
        """The tokens the grammar allows next, as a ctypes uint32 array: token i is bit i % 32 of
        word i // 32 (the model's stop tokens stand for llguidance's end token). It is this
        constraint's own array, overwritten by the next call."""
        self._check()
        bits = self._bits
        self.matcher.unsafe_compute_mask_ptr(ctypes.addressof(bits), ctypes.sizeof(bits))
        self._check()
        end = self.vocabulary.end_token
        if bits[end >> 5] >> (end & 31) & 1:
            for token in self.vocabulary.stop_token_ids:
                bits[token >> 5] |= 1 << (token & 31)
        else:
            for token in self.vocabulary.stop_token_ids:
                bits[token >> 5] &= ~(1 << (token & 31))
        return bits

    def allowed(self):
        """A list of bools over the vocabulary: the tokens the grammar allows next."""
        bits = self.allowed_bits()
        return [bool(bits[token >> 5] >> (token & 31) & 1) for token in range(self.vocabulary.n_vocab)]

    def mask(self, logits):
        """Set the logits (a writeable float32 row) of every token the grammar forbids to -inf, in place."""
        return sampler.mask_logits(logits, self.allowed_bits())

    def allowed_prefix(self, tokens):
        """How many of `tokens`, in order, the grammar accepts from where it is now (it does not move):
        speculation ends a proposal at the first token the grammar refuses."""
        return self.matcher.validate_tokens([int(t) for t in tokens])

    def accept(self, token):
        """Move on by the sampled token (a stop token counts as the end)."""
        if token in self.vocabulary.stop_token_ids:
            token = self.vocabulary.end_token
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise GrammarError(f"token {token} does not continue the grammar")

    def _check(self):
        if self.matcher.is_error():
            raise GrammarError(_readable(self.matcher.get_error()))


def _readable(message):
    """llguidance's message, one line, without its internal trace."""
    first = message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"
    return first[:500]
