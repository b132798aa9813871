"""Hypothesis strategies shared by the tests (append new ones in their own section)."""

import json

import numpy as np
from hypothesis import strategies as st

from krafla_twisted.engine import formats
from tests.support import tiny_models

# ------------------------------------------------------------------------------------------
# Tiny model shapes (tests/support/tiny_models.py)


@st.composite
def tiny_model_shapes(draw, weight_type="f32", max_dim=128):
    """Keyword arguments for write_tiny_model's shape: GQA ratios 1..4, even head widths,
    odd and even vocab sizes; every matrix input a multiple of 32 for quantized types, of 256 for
    k-quants."""
    quantized = weight_type in tiny_models.QUANTIZED
    n_kv_heads = draw(st.integers(1, 3))
    n_heads = n_kv_heads * draw(st.integers(1, 4))
    if weight_type in tiny_models.KQUANTS:
        # every matrix input a multiple of 256: head_dim a multiple of 256 / gcd(256, n_heads)
        step = 256 // np.gcd(256, n_heads)
        head_dim = step * draw(st.integers(1, max(1, 128 // step)))
        dim = 256 * draw(st.integers(1, 2))
        ffn_dim = 256 * draw(st.integers(1, 2))
    elif quantized:
        # n_heads * head_dim must be a multiple of 32: head_dim a multiple of 32 / gcd.
        step = 32 // np.gcd(32, n_heads)
        head_dim = step * draw(st.integers(1, 64 // step))  # step is 4, 8, 16 or 32: even
        dim = 32 * draw(st.integers(1, max_dim // 32))
        ffn_dim = 32 * draw(st.integers(1, 2 * max_dim // 32))
    else:
        head_dim = 2 * draw(st.integers(1, 16))
        dim = draw(st.integers(1, max_dim))
        ffn_dim = draw(st.integers(1, 2 * max_dim))
    return dict(
        n_vocab=draw(st.integers(2, 300)),
        dim=dim,
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        max_seq=draw(st.sampled_from([16, 32, 64, 128])),
    )


@st.composite
def tiny_models_args(draw, archs=tiny_models.ARCHS, weight_types=tiny_models.WEIGHT_TYPES):
    """(arch, weight_type, kwargs) for write_tiny_model, kwargs including seed and the shape."""
    arch = draw(st.sampled_from(archs))
    weight_type = draw(st.sampled_from(weight_types))
    kwargs = draw(tiny_model_shapes(weight_type))
    kwargs["seed"] = draw(st.integers(0, 2**32 - 1))
    return arch, weight_type, kwargs


# ------------------------------------------------------------------------------------------
# Container contents (krafla_twisted/engine/formats.py)

names = st.text(st.characters(exclude_characters="\0", exclude_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda s: len(s.encode()) <= formats.MAX_NAME)
ints = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=False, width=64)  # NaN != NaN would make equality checks useless
metadata_values = st.one_of(
    ints,
    floats,
    st.text(max_size=60),
    st.lists(ints, max_size=12),
    st.lists(floats, min_size=1, max_size=12),  # an empty list is written as ints
)


@st.composite
def tensor_shapes(draw, tensor_type):
    """1 to 4 dimensions, the last a multiple of the type's block, at most ~2k elements."""
    n_dims = draw(st.integers(1, formats.MAX_DIMS))
    shape = [draw(st.integers(1, 5)) for _ in range(n_dims - 1)]
    shape.append(tensor_type.block * draw(st.integers(1, 3 if tensor_type.block > 1 else 70)))
    return tuple(shape)


@st.composite
def tensors(draw):
    """(type, shape, raw bytes) with random contents (any bit pattern is a valid tensor)."""
    tensor_type = draw(st.sampled_from(list(formats.TENSOR_TYPES.values())))
    shape = draw(tensor_shapes(tensor_type))
    n_bytes = tensor_type.nbytes(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)
    return tensor_type, shape, raw


@st.composite
def containers(draw, magic=None):
    """A formats.Container with random metadata of every kind and random tensors."""
    magic = magic or draw(st.sampled_from([formats.MODEL_MAGIC, formats.TOKENIZER_MAGIC]))
    container = formats.Container(magic)
    container.metadata.update(draw(st.dictionaries(names, metadata_values, max_size=8)))
    for name, (tensor_type, shape, raw) in draw(st.dictionaries(names, tensors(), max_size=5)).items():
        container.add(name, tensor_type, shape, raw)
    return container


# ------------------------------------------------------------------------------------------
# HTTP API request bodies (tests/test_api_validation.py; owner: server)

# Text includes lone surrogates sometimes: JSON can escape them ("\\ud800") though they are not characters.
_json_text = st.text(max_size=8) | st.text(st.characters(categories=["Cs"]) | st.characters(), min_size=1, max_size=4)
json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | _json_text)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


def _not(*kinds):
    """JSON values of none of the given kinds ("null", "bool", "int", "number", "string", "array", "object")."""
    by_kind = {
        "bool": st.booleans(),
        "int": st.integers(-(2**40), 2**40),
        "number": st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()),
        "string": st.text(max_size=8),
        "array": st.lists(json_scalars, max_size=3),
        "object": st.dictionaries(st.text(max_size=5), json_scalars, max_size=3),
    }
    return st.one_of(*(strategy for kind, strategy in by_kind.items() if kind not in kinds))


def _integer_outside(low, high=None):
    below = st.integers(-(2**70), low - 1)
    return below if high is None else below | st.integers(high + 1, 2**70)


def _number_outside(low, high=None):
    below = st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False)
    if high is None:
        return below
    return below | st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False)


_sampling_invalid = {
    "temperature": _not("int", "number") | _number_outside(0.0, 2.0),
    "top_p": _not("int", "number") | _number_outside(0.0, 1.0),
    "top_k": _not("int") | _integer_outside(0, 2**31 - 1),
    "repeat_penalty": (_not("int", "number") | st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
                       | st.integers(max_value=0)),
    "repeat_last_n": _not("int") | _integer_outside(-1, 2**31 - 1),
    "frequency_penalty": _not("int", "number") | _number_outside(-2, 2),
    "presence_penalty": _not("int", "number") | _number_outside(-2, 2),
    "min_p": _not("int", "number") | _number_outside(0, 1),
    "ignore_eos": _not("bool"),
    "seed": _not("int") | _integer_outside(-(2**63), 2**64 - 1),
    "max_tokens": _not("int") | _integer_outside(1),
    "max_completion_tokens": _not("int") | _integer_outside(1),
    "stop": (_not("string", "array") | st.lists(st.text(min_size=1), min_size=5, max_size=7)
             | st.lists(_not("string"), min_size=1, max_size=3) | st.just([""])),
    "stream": _not("bool"),
    "n": _not("int") | _integer_outside(1, 128),
    "model": _not("string"),
}
# Types only; the refusals and the new fields' values are tested on their own.
_chat_invalid = dict(
    _sampling_invalid,
    messages=(_not("array") | st.just([]) | st.lists(_not("object"), min_size=1, max_size=2)
              | st.lists(st.fixed_dictionaries({"role": st.text(max_size=9).filter(lambda r: r not in ("system", "developer", "user", "assistant")),
                                                "content": st.text()}), min_size=1, max_size=2)
              | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _not("string", "array")}), min_size=1, max_size=2)),
    logprobs=_not("bool"),
    tools=_not("array"),
    response_format=_not("object") | st.fixed_dictionaries({"type": st.sampled_from(["xml", "json_schema", None, 3])}),
    top_logprobs=_not("int") | _integer_outside(0, 20),
    logit_bias=_not("object") | st.fixed_dictionaries({"1": _not("int", "number") | _number_outside(-100, 100)}),
    tool_choice=_not("string", "object") | st.sampled_from(["always", "required"]),
)
_completion_invalid = dict(
    _sampling_invalid,
    prompt=(_not("string", "array") | st.just([]) | st.lists(st.integers(1000, 2**40), min_size=1, max_size=3)
            | st.lists(st.integers(-(2**40), -1), min_size=1, max_size=3) | st.lists(st.lists(st.text(), min_size=1, max_size=2), min_size=1, max_size=2)),
    echo=_not("bool"),
    suffix=_not("string"),
    best_of=_not("int") | _integer_outside(1),
)


@st.composite
def invalid_api_bodies(draw, kind):
    """(field, body): a valid chat ("chat") or text ("text") request with one field made invalid."""
    table = _chat_invalid if kind == "chat" else _completion_invalid
    body = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    name = draw(st.sampled_from(sorted(table)))
    body[name] = draw(table[name])
    return name, body


@st.composite
def arbitrary_api_bodies(draw, kind):
    """Any JSON object mixing the real field names (with any values) and unknown ones."""
    names = sorted(_chat_invalid if kind == "chat" else _completion_invalid) + ["stream_options", "user", "frequency_penalty"]
    fields = draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=6), json_values, max_size=6))
    return fields


# ------------------------------------------------------------------------------------------
# Tokenizer text (tests/test_tokenizer.py; owner: tokenizer)

# Pieces that stress the pre-tokenizers: space and newline runs, contractions in both cases,
# digit runs, combining marks, scripts without spaces, emoji sequences, non-ASCII spaces.
_tokenizer_pieces = st.one_of(
    st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "'s", "'LL", "'ve", "'D", "...", "!!", "(",
                     "0", "123", "12345", "Hello", " world", "é", "e\u0301", "ß", "ſ", "中文", "😀", "👩\u200d💻",
                     "\u00a0", "\u3000", "\u2028", "ﬁ", "١٢٣", "Ⅻ", "ก่", "\x1c", "\0"]),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6),
    st.text(alphabet="abcXYZ019 \n\t'.,-_", max_size=12),
)
tokenizer_texts = st.lists(_tokenizer_pieces, max_size=10).map("".join)

# o200k splits words where the case changes: upper, title and lower case letters of several scripts,
# modifier and other letters (on both sides of a case change), marks before and after letters,
# contractions in any case (U+017F matches s), and the '/' that its punctuation run keeps.
_cased_pieces = st.one_of(
    st.sampled_from(["HelloWorld", "XMLHttp", "camelCase", "ǅungla", "ǈ", "ᾈa", "ʰa", "aʰB", "Aʰ", "中A", "A中",
                     "\u0301A", "a\u0301B", "A\u0301", " \u0301", "'S", "'Re", "n'T", "'ſ", "x'll", "/", "!\n/", "a/b",
                     "\r\n/", ".//", "ΣΊΣ", "Σίσ", "ẞ", "々", "ー"]),
    st.text(st.characters(categories=("Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Zs", "Po",
                                      "Sm", "So")), max_size=6),
    st.text(alphabet="aAbBǅʰ中\u0301'sStT/!1 \r\n", max_size=12),
)
cased_tokenizer_texts = st.lists(st.one_of(_tokenizer_pieces, _cased_pieces), max_size=10).map("".join)

# ------------------------------------------------------------------------------------------
# Weights for the quantizers (krafla_twisted/convert/quantize.py)


@st.composite
def weight_rows(draw, max_rows=4, max_blocks=4):
    """float32 (rows, 32·k): values in [-1, 1] with exact ties and halves, times one scale from
    1e-30 (scales that underflow f16) to 1e30 (scales that overflow it)."""
    from hypothesis.extra import numpy as hnp

    shape = (draw(st.integers(1, max_rows)), 32 * draw(st.integers(1, max_blocks)))
    elements = st.one_of(st.floats(-1, 1, width=32), st.sampled_from([0.0, 0.5, -0.5, 1.0, -1.0, 0.25]))
    values = draw(hnp.arrays(np.float32, shape, elements=elements))
    scale = draw(st.sampled_from([1e-30, 1e-6, 1.0, 127.0, 1e3, 1e7, 1e30]))
    return values * np.float32(scale)


# ------------------------------------------------------------------------------------------
# Tools and JSON schemas (tests/test_tools.py, tests/test_structured.py; owner: agents)

_tool_names = st.sampled_from(["get_weather", "lookup", "send_mail", "a-b_c"])
_tool_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=10)
tool_arguments = st.dictionaries(st.sampled_from(["city", "n", "flag", "tags", "é"]),
                                 st.one_of(st.integers(-1000, 1000), st.booleans(), _tool_text,
                                           st.lists(_tool_text, max_size=2)), max_size=3)


@st.composite
def tool_lists(draw):
    """OpenAI tool objects with distinct names, with or without descriptions and parameters."""
    names = draw(st.lists(_tool_names, unique=True, max_size=3))
    out = []
    for name in names:
        function = {"name": name}
        if draw(st.booleans()):
            function["description"] = draw(_tool_text)
        if draw(st.booleans()):
            function["parameters"] = {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}
        out.append({"type": "function", "function": function})
    return out


@st.composite
def tool_conversations(draw, tool_list, parallel=True):
    """A user turn, then rounds of assistant calls with their tool results, maybe a plain answer,
    ending with a user or tool message (so a generation prompt follows)."""
    messages = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_tool_text)})
    messages.append({"role": "user", "content": draw(_tool_text)})
    for round_index in range(draw(st.integers(0, 2))):
        count = draw(st.integers(1, 3)) if parallel else 1
        calls = [{"id": f"call_{round_index}_{i}", "type": "function",
                  "function": {"name": draw(_tool_names), "arguments": json.dumps(draw(tool_arguments))}}
                 for i in range(count)]
        content = draw(_tool_text) if parallel and draw(st.booleans()) else ""
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": draw(_tool_text)})
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(_tool_text).strip() or "ok"})
            messages.append({"role": "user", "content": draw(_tool_text)})
    return messages


_schema_leaves = st.one_of(
    st.just({"type": "string", "maxLength": 12}),
    st.just({"type": "integer", "minimum": -100, "maximum": 100}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", "ü"]), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.just({"type": "string", "pattern": "^[a-z]{1,6}$"}),
)
_schema_property_names = st.sampled_from(["name", "age", "colour", "items", "ok", "x", "nested"])


def _object_schema(properties, draw_required):
    return {"type": "object", "properties": properties, "required": draw_required, "additionalProperties": False}


@st.composite
def json_schemas(draw, depth=2):
    """Schemas within the supported subset (docs/api.md): objects with fixed properties, arrays with
    bounded items, enums, strings with a length or pattern, bounded integers, booleans, null (every value
    bounded, so a reply always completes)."""
    if depth == 0:
        return draw(_schema_leaves)
    kind = draw(st.sampled_from(["object", "object", "array", "leaf", "anyOf"]))
    if kind == "leaf":
        return draw(_schema_leaves)
    if kind == "array":
        return {"type": "array", "items": draw(json_schemas(depth=depth - 1)), "maxItems": 3}
    if kind == "anyOf":
        return {"anyOf": [draw(_schema_leaves), draw(_schema_leaves)]}
    names = draw(st.lists(_schema_property_names, min_size=1, max_size=3, unique=True))
    properties = {name: draw(json_schemas(depth=depth - 1)) for name in names}
    required = [name for name in names if draw(st.booleans())] or names[:1]
    return _object_schema(properties, required)


# ------------------------------------------------------------------------------------------
# ggml's q4_1, q5_0 and q5_1 weights (engine_c/src/kernels/legacy.h)

LEGACY_TYPES = ("q4_1", "q5_0", "q5_1")


@st.composite
def legacy_matmul_problems(draw, max_rows=13, max_blocks=7, max_tokens=9):
    """(type, rows, cols, n_tokens, row_begin, row_end, kind, seed): odd row and token counts, a row
    range inside the rows, and how the weights are made: "quantized" (normal floats through gguf-py's
    quantizer), "random" (random quant bits, scales and minimums) or "extreme" (every quant at its
    largest and every activation at +-127, the integer sums' worst case)."""
    type_name = draw(st.sampled_from(LEGACY_TYPES))
    rows = draw(st.integers(1, max_rows))
    cols = 32 * draw(st.integers(1, max_blocks))
    n_tokens = draw(st.integers(1, max_tokens))
    row_begin = draw(st.integers(0, rows - 1))
    row_end = draw(st.integers(row_begin + 1, rows))
    kind = draw(st.sampled_from(("quantized", "random", "extreme")))
    return type_name, rows, cols, n_tokens, row_begin, row_end, kind, draw(st.integers(0, 2**32 - 1))


# Several sequences stepping together (kr_batch_eval, tests/test_batch_eval.py)

LOGITS_MODES = ("none", "last", "all")


@st.composite
def sequence_schedules(draw, max_vocab, max_steps=6):
    """One sequence as a scheduler with chunked prefill would run it: `tokens`, `steps` (how many
    tokens each of its steps takes: prompt chunks of 1 to 9, then 1 per generated token), `modes`
    (the logits each step asks for), `start` (the step it arrives at) and its session's spare
    context and batch."""
    chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    steps = chunks + [1] * draw(st.integers(0, max_steps))
    return dict(
        tokens=draw(st.lists(st.integers(0, max_vocab - 1), min_size=sum(steps), max_size=sum(steps))),
        steps=steps,
        modes=draw(st.lists(st.sampled_from(LOGITS_MODES), min_size=len(steps), max_size=len(steps))),
        start=draw(st.integers(0, 8)),
        spare_ctx=draw(st.integers(0, 8)),
        batch=draw(st.integers(1, 16)),
    )


@st.composite
def batch_plans(draw, max_vocab, n_others=(1, 3, 7)):
    """A request (asking for every logit) and 1, 3 or 7 others (sequence_schedules), the thread
    count of the model they share, and a seed for the order of the items in each step."""
    n = draw(st.sampled_from(n_others))
    request = draw(sequence_schedules(max_vocab))
    request["modes"] = ["all"] * len(request["steps"])  # every position of the request is compared
    return dict(
        sequences=[request] + [draw(sequence_schedules(max_vocab)) for _ in range(n)],
        threads=draw(st.integers(1, 4)),
        order_seed=draw(st.integers(0, 2**32 - 1)),
    )


# ------------------------------------------------------------------------------------------
# k-quant matmuls (tests/test_kquant.py)


@st.composite
def kquant_problems(draw):
    """(type, rows, cols, n_tokens, row_begin, row_end, seed, encoded): odd row counts around the
    groups of 8, 1 to 4 super-blocks per row or 17 to 40 (long rows; q4_K packs those of more than
    20 in column slices: kernels.h, kr_slice_blocks), 1 to 11 tokens (several tiles), any row range;
    `encoded` picks weights encoded from floats instead of random blocks."""
    type_name = draw(st.sampled_from(("q4_K", "q5_K", "q6_K")))
    rows = draw(st.integers(1, 27))
    row_begin = draw(st.integers(0, rows - 1))
    row_end = draw(st.integers(row_begin + 1, rows))
    n_blocks = draw(st.one_of(st.integers(1, 4), st.integers(17, 40)))
    return (type_name, rows, 256 * n_blocks, draw(st.integers(1, 11)), row_begin, row_end,
            draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))
