"""GBNF (llama-server's `grammar` field) translated to llguidance's Lark (krafla_twisted/generation/gbnf.py).

The reference is llama.cpp itself: its grammar tests' vectors (each grammar with the strings it must
accept and refuse, tests/data/gbnf/vectors.json) and its example grammars (tests/data/gbnf/*.gbnf,
with strings a reader of them can check). A string is run through llguidance over a byte-level
vocabulary, so what is checked is the grammar's language, not a tokenizer's."""

import json
from pathlib import Path

import pytest

from krafla_twisted.generation import gbnf, grammar
from tests.support import byte_grammar

DATA = Path(__file__).parent / "data" / "gbnf"
VECTORS = json.loads((DATA / "vectors.json").read_text(encoding="utf-8"))["cases"]


def accepts(gbnf_text, text):
    """Whether the translated grammar's language holds `text` (whole: the grammar may end after it)."""
    return byte_grammar.accepts(grammar.lark_grammar(gbnf.to_lark(gbnf_text)), text)


@pytest.mark.parametrize("case", VECTORS, ids=[case["name"] for case in VECTORS])
def test_llama_cpp_vectors(case):
    """Every string llama.cpp's tests expect a grammar to accept is accepted, every one it expects
    refused is refused."""
    for text in case["accepts"]:
        assert accepts(case["grammar"], text), text
    for text in case["refuses"]:
        assert not accepts(case["grammar"], text), text


@pytest.mark.parametrize("name, good, bad", [
    ("json.gbnf", ['{"a": 1, "b": [true, null, "x\\n"]}', '{}', '{"k": {"n": -12.5e3}}'],
     ['[1, 2]', '{"a" 1}', '{"a": tru}', '{"a": "\x01"}']),
    ("arithmetic.gbnf", ["x=1\n", "a = (b +2*c)\nd=4\n"], ["x=\n", "=1\n", "x=1"]),
    ("chess.gbnf", ["1. e4 e5\n2. Nf3 Nc6\n", "1. d4 Nf6\n2. c4 O-O\n"], ["1. e4 e5\n", "1. e9 e5\n2. a3 a6\n"]),
    ("list.gbnf", ["- milk\n- eggs\n"], ["milk\n", "- \n", "- a\u2028b\n"]),
])
def test_llama_cpp_example_grammars(name, good, bad):
    """llama.cpp's example grammars, unchanged: texts of the shape each describes are accepted, near
    misses are not (a JSON array where an object is the root, a chess move off the board, a list
    line holding a Unicode line separator)."""
    text = (DATA / name).read_text(encoding="utf-8")
    for sample in good:
        assert accepts(text, sample), sample
    for sample in bad:
        assert not accepts(text, sample), sample


def test_translation_details():
    """Escapes of every kind, a class with `]`, `-` and `^` as characters, `.` over a multi-byte
    character, a rule defined twice (its alternatives join, as llama.cpp does), names with dashes
    and capitals, comments and rules that span lines inside groups."""
    assert accepts(r'root ::= "\x41\u00e9\U0001F600\t\"\\"', 'Aé😀\t"\\')
    assert accepts(r'root ::= [\]\-^a]+', "]-^a")
    assert not accepts(r'root ::= [\]\-^a]+', "b")
    assert accepts('root ::= . "!"', "€!") and not accepts('root ::= . "!"', "ab!")
    twice = 'root ::= "a"\nroot ::= "b"\n'
    assert accepts(twice, "a") and accepts(twice, "b")
    spread = 'root ::= Word-One ( # a comment\n  "x"\n  | "y" )\nWord-One ::= [A-Z]\nword_one ::= "z"\n'
    assert accepts(spread, "Ay") and not accepts(spread, "zy")
    assert accepts('root ::= ("ab"?){2}', "abab") and accepts('root ::= ("ab"?){2}', "")


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ('expr ::= "a"', "no root rule"),
    ('root ::= item\n', "'item' is used but not defined"),
    ('root ::= "abc', "unterminated string"),
    ('root ::= "a\nb"', "cannot span lines"),
    (r'root ::= "\q"', r"unknown escape \q"),
    (r'root ::= "\x4"', "hex digits"),
    ('root ::= [z-a]', "backwards"),
    ('root ::= []', "matches nothing"),
    ('root ::= "a"{3,1}', "below the least"),
    ('root ::= "a"{99999}', "at most"),
    ('root ::= <[10]> "a"', "token references"),
    ('root ::= ("a"', "expected )"),
    ('root "a"', "expected ::="),
    ('root ::= "a" )', "end of the line"),
])
def test_errors_name_the_place(text, message):
    """What the translation cannot read is a GrammarError naming the line and column."""
    with pytest.raises(grammar.GrammarError, match="line|empty") as raised:
        gbnf.to_lark(text)
    assert message in str(raised.value)
