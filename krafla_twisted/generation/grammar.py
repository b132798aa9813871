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

Every schema is `bounded` first: where it sets no bound of its own, strings, arrays, objects and
numbers get one (the numbers below), so a small model that hesitates cannot pad a value until
max_tokens. `schema_in_texts` finds the JSON schema a client library wrote into the prompt of a
json_object request (instructor's JSON mode, pydantic-ai's prompted output).
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
# A response_format reply may also be laid out as models learnt to write JSON (json.dumps(indent=2)):
# between two tokens of the value at most one newline and eight spaces, so it is still bounded and
# cannot be padded. Qwen2.5-Coder asked for a json_object with the compact form alone writes `{}`
# (its next token after `{` would be a newline); with this it writes the object llama-server gets.
RESPONSE_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"\n? {0,8}", "item_separator": ",",
                         "key_separator": ":"}


# Bounds a value gets where its schema sets none of its own (docs/api.md, "Structured output").
STRING_MAX_LENGTH = 200        # characters in a string
KEY_MAX_LENGTH = 40            # characters in a key of an object whose keys the schema leaves free
ARRAY_MAX_ITEMS = 16
OBJECT_MAX_PROPERTIES = 16     # keys of an object whose schema names none
NUMBER_LIMIT = 10 ** 15        # |number| <= 1e15: at most 16 digits before the point, no exponent
NUMBER_STEP = 1e-6             # a number's multipleOf: at most 6 digits after the point
FREE_VALUE_DEPTH = 2           # a value of any type ({}, json_object's values) nests arrays/objects this deep
MAX_SCHEMA_DEPTH = 64          # a schema nested deeper is refused (a request body nests at most 32 levels)

CLOSING_BYTES = frozenset(b'"]}')   # what a closing token is made of (Constraint.close_within)


def closing_reserve(max_tokens):
    """How many of a reply's last tokens close its JSON value: an eighth of the reply, at least 12
    and at most 64 (a value nested 3 levels inside a key needs about 10 to close)."""
    return min(64, max(12, max_tokens // 8))


# Keywords that say nothing about which values are valid: a schema with only these is any value.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly", "x-guidance"})
_ALL_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


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
    """The llguidance grammar of replies that are one JSON value valid against `schema` (a dict),
    within the bounds `bounded` adds."""
    llguidance = _llguidance()
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded(schema)), overrides=RESPONSE_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"the JSON schema cannot be used: {e}") from None


def lark_grammar(text):
    """The llguidance grammar of a Lark-syntax grammar text (may hold `%json {...}` rules)."""
    return _llguidance().LLMatcher.grammar_from_lark(text)


def json_rule(schema):
    """A Lark rule body that matches one JSON value valid against `schema` (within the bounds
    `bounded` adds), written compactly."""
    schema = bounded(schema)
    guidance = dict(schema.get("x-guidance") or {})
    guidance.update(JSON_OPTIONS)
    schema["x-guidance"] = guidance
    return "%json " + json.dumps(schema)


# ---------------------------------------------------------------------------------------------
# Bounds where a schema has none, so that a value can close before max_tokens

def free_value(depth=FREE_VALUE_DEPTH):
    """The schema of any JSON value within the bounds: a string, a number, true, false, null, and
    while `depth` > 0 an array or an object of such values one level less deep."""
    choices = [{"type": "null"}, {"type": "boolean"},
               {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP},
               {"type": "string", "maxLength": STRING_MAX_LENGTH}]
    if depth > 0:
        inner = free_value(depth - 1)
        choices.append({"type": "array", "items": inner, "maxItems": ARRAY_MAX_ITEMS})
        choices.append(_free_object(inner))
    return {"anyOf": choices}


def _free_object(values):
    """An object of at most OBJECT_MAX_PROPERTIES keys of at most KEY_MAX_LENGTH characters, each
    value valid against `values`."""
    return {"type": "object", "patternProperties": {f"^.{{1,{KEY_MAX_LENGTH}}}$": values},
            "additionalProperties": False, "maxProperties": OBJECT_MAX_PROPERTIES}


def bounded(schema, level=0):
    """A copy of `schema` in which every value the schema leaves unbounded gets the module's bounds:
    a string without maxLength (and without enum or const) at most STRING_MAX_LENGTH characters; an
    array without maxItems at most ARRAY_MAX_ITEMS items; a number or integer without a minimum or
    maximum within +-NUMBER_LIMIT, and a number without multipleOf a multiple of NUMBER_STEP; an
    object with `properties` and no `additionalProperties` only those properties (as llama.cpp's
    grammar reads it); an object that names no keys at most OBJECT_MAX_PROPERTIES keys of at most
    KEY_MAX_LENGTH characters; the other values of an object that allows other keys, and a value of
    any type (`{}`, `true`), free_value(). A bound never goes below the schema's own minimum
    (minLength, minItems, ...), so no satisfiable schema becomes unsatisfiable."""
    if level > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels")
    if schema is True:
        return free_value()
    if not isinstance(schema, dict):
        return schema   # false, or not a schema: llguidance says what is wrong with it
    if not set(schema) - _ANNOTATIONS:
        return {**schema, **free_value()}
    inner = level + 1
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: bounded(value, inner) for name, value in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if key in schema and not (key == "additionalProperties" and schema[key] is False):
            out[key] = bounded(schema[key], inner)
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            out[key] = [bounded(value, inner) for value in schema[key]]
    if any(key in schema for key in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not")):
        # bounded by its values or by the schemas it refers to; a `not` is left as it is (bounding
        # inside it would let more through)
        return out
    types = schema.get("type", sorted(_ALL_TYPES))
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "string" in types and "maxLength" not in schema:
        out["maxLength"] = max(STRING_MAX_LENGTH, _count(schema.get("minLength")))
    if "array" in types:
        _bound_array(schema, out)
    if "object" in types:
        _bound_object(schema, out)
    if types & {"number", "integer"}:
        _bound_number(schema, out, "number" in types)
    return out


def _count(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _bound_array(schema, out):
    prefix = schema.get("prefixItems")
    if "items" not in schema:
        out["items"] = free_value()
    if "maxItems" not in schema:
        out["maxItems"] = max(ARRAY_MAX_ITEMS, _count(schema.get("minItems")),
                              len(prefix) if isinstance(prefix, list) else 0)


def _bound_object(schema, out):
    properties = schema.get("properties")
    patterns = schema.get("patternProperties")
    additional = schema.get("additionalProperties", True)
    if "additionalProperties" not in schema and isinstance(properties, dict) and not patterns:
        out["additionalProperties"] = False   # `properties: {}` too: a tool without parameters takes `{}`
    elif not properties and not patterns and not schema.get("required") and additional is True:
        out.update({key: value for key, value in _free_object(free_value()).items() if key != "type"})
        out["maxProperties"] = schema.get("maxProperties", max(OBJECT_MAX_PROPERTIES, _count(schema.get("minProperties"))))
    elif additional is True:
        # other keys stay allowed, their values bounded (llguidance 1.9 refuses every object when
        # maxProperties is given beside properties, so their number is not bounded here)
        out["additionalProperties"] = free_value()


def _bound_number(schema, out, fractions):
    def number(key):
        value = schema.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    low = number("minimum") if number("minimum") is not None else number("exclusiveMinimum")
    high = number("maximum") if number("maximum") is not None else number("exclusiveMaximum")
    if low is None and (high is None or high > -NUMBER_LIMIT):
        out["minimum"] = -NUMBER_LIMIT
    if high is None and (low is None or low < NUMBER_LIMIT):
        out["maximum"] = NUMBER_LIMIT
    if fractions and "multipleOf" not in schema:
        out["multipleOf"] = NUMBER_STEP


# ---------------------------------------------------------------------------------------------
# A schema written into the prompt (json_object requests of client libraries)

MAX_SCHEMA_SEARCHES = 64   # JSON objects tried per request: a hostile prompt cannot make the search long


def schema_in_texts(texts):
    """The JSON schema of an object that the last of `texts` holding one writes (or None): a JSON
    object in the text whose "properties" is an object of schemas and whose "type", if it has one,
    is "object". Client libraries put the schema of a json_object request's reply there
    (docs/clients.md): instructor's JSON mode as `json.dumps(schema, indent=2)` in the system
    message, pydantic-ai's prompted output as `json.dumps(schema)` in its instructions."""
    decoder = json.JSONDecoder()
    tries = 0
    for text in reversed(list(texts)):
        found = None
        start = text.find("{")
        while start >= 0 and tries < MAX_SCHEMA_SEARCHES:
            after = text[start + 1:start + 64].lstrip()
            if not after.startswith('"'):
                start = text.find("{", start + 1)
                continue
            tries += 1
            try:
                value, end = decoder.raw_decode(text, start)
            except (ValueError, RecursionError):
                start = text.find("{", start + 1)
                continue
            if _is_object_schema(value):
                found = value
            start = text.find("{", end)
        if found is not None:
            return found
    return None


def _is_object_schema(value):
    if not isinstance(value, dict) or value.get("type", "object") != "object":
        return False
    properties = value.get("properties")
    return isinstance(properties, dict) and bool(properties) and all(isinstance(p, dict) for p in properties.values())


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
        # the tokens that only close a JSON value (quotes and brackets, after the space a separator
        # ends with), those starting with a quote first (inside a string a bracket is text):
        # Constraint.close_within prefers them in this order
        quotes = brackets = 0
        controls = set(special)
        for token, piece in enumerate(tokens):
            piece = piece.lstrip(b" ")
            if token not in controls and piece and set(piece) <= CLOSING_BYTES:
                if piece.startswith(b'"'):
                    quotes |= 1 << token
                else:
                    brackets |= 1 << token
        self.closing_tokens = (quotes, brackets)
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
    """One reply's grammar state. `mask` before sampling, `accept` after; `done` when complete.
    With `close_within(n)`, the last tokens of an n-token reply close the value (see there)."""

    def __init__(self, vocabulary, grammar):
        llguidance = _llguidance()
        self.vocabulary = vocabulary
        self.accepted = 0           # tokens accepted so far
        self.closing_from = None    # from this many accepted tokens on, closing tokens are preferred
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

    def close_within(self, max_tokens):
        """Make a JSON value close before `max_tokens` tokens where the grammar lets it: once fewer
        than closing_reserve(max_tokens) are left, each step allows only the tokens that are nothing
        but quotes and closing brackets whenever the grammar allows one of them: first those that
        start with a quote (`"`, `"}`, ...: an open string ends), else the brackets (`}`, `]]`, ...),
        so open strings, arrays and objects end; where it allows none (a key's first character, a
        literal, a required property still to write) the step is as the grammar says."""
        self.closing_from = max(0, max_tokens - closing_reserve(max_tokens))

    def mask(self, logits):
        """Set the logits (a writeable float32 row) of every token the grammar forbids to -inf, in place."""
        bits = self.allowed_bits()
        if self.closing_from is not None and self.accepted >= self.closing_from:
            self._prefer_closing(bits)
        return sampler.mask_logits(logits, bits)

    def _prefer_closing(self, bits):
        raw = bytes(bits)
        allowed = int.from_bytes(raw, "little")
        for preferred in self.vocabulary.closing_tokens:
            closing = allowed & preferred
            if closing:
                ctypes.memmove(bits, closing.to_bytes(len(raw), "little"), len(raw))
                return

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
        self.accepted += 1

    def _check(self):
        if self.matcher.is_error():
            raise GrammarError(_readable(self.matcher.get_error()))


def _readable(message):
    """llguidance's message, one line, without its internal trace."""
    first = message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"
    return first[:500]
