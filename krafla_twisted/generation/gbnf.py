"""llama.cpp's GBNF grammars (llama-server's `grammar` field) as llguidance's Lark-like grammars.

GBNF, as llama.cpp's grammars/README.md describes it: rules `name ::= alternatives`, alternatives
separated by `|`, sequences of string literals ("..." with \\x, \\u, \\U, \\t, \\n, \\r escapes),
character classes ([a-z], [^"\\\\]), `.` (any character), rule names and parenthesised groups,
each optionally followed by `*`, `+`, `?` or `{m}`, `{m,}`, `{m,n}`, `{,n}`; `#` comments; `root`
is the start. The translation is one to one: literals become JSON-escaped Lark strings, classes
and `.` regular expressions with every character written as \\x{HEX} (so nothing in them needs
escaping), rule names lowercase Lark names. llama.cpp's newer token references (`<[id]>`,
`!<[id]>`, `<token>`) have no Lark counterpart and are refused, as are undefined rules and a
grammar without `root`, with the line and column of the problem.
"""

import json
import re

from krafla_twisted.generation.grammar import GrammarError

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_REPEAT = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^",
            "/": "/", "'": "'", "0": "\0", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "e": "\x1b"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
MAX_REPEAT = 10000   # {m,n} bounds above this are refused (llguidance expands them)


class _Reader:
    """The grammar's text with a position; errors name the line and column."""

    def __init__(self, text):
        self.text = text
        self.pos = 0

    def error(self, message, pos=None):
        pos = self.pos if pos is None else pos
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return GrammarError(f"grammar, line {line} column {column}: {message}")

    def peek(self, n=1):
        return self.text[self.pos:self.pos + n]

    def at_end(self):
        return self.pos >= len(self.text)

    def skip_space(self, newlines):
        """Skip blanks and comments; newlines too when `newlines` (inside a group, after `::=` or `|`)."""
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char in " \t" or (newlines and char in "\r\n"):
                self.pos += 1
            else:
                return


def _char(reader, closing):
    """One (possibly escaped) character of a literal or class; `closing` ends it and is not read here."""
    text = reader.text
    if reader.at_end():
        raise reader.error("unterminated " + ("string" if closing == '"' else "character class"))
    char = text[reader.pos]
    if char == "\n" and closing == '"':
        raise reader.error("a string literal cannot span lines")
    if char != "\\":
        reader.pos += 1
        return char
    kind = text[reader.pos + 1:reader.pos + 2]
    if kind in _HEX_ESCAPES:
        digits = text[reader.pos + 2:reader.pos + 2 + _HEX_ESCAPES[kind]]
        if len(digits) != _HEX_ESCAPES[kind] or not re.fullmatch(r"[0-9a-fA-F]+", digits):
            raise reader.error(f"\\{kind} needs {_HEX_ESCAPES[kind]} hex digits")
        value = int(digits, 16)
        if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
            raise reader.error(f"\\{kind}{digits} is not a Unicode character")
        reader.pos += 2 + len(digits)
        return chr(value)
    if kind in _ESCAPES:
        reader.pos += 2
        return _ESCAPES[kind]
    raise reader.error(f"unknown escape \\{kind}")


def _literal(reader):
    reader.pos += 1   # the opening quote
    chars = []
    while reader.peek() != '"':
        chars.append(_char(reader, '"'))
    reader.pos += 1
    return json.dumps("".join(chars), ensure_ascii=False)


def _hex(char):
    return "\\x{%x}" % ord(char)


def _class(reader):
    start = reader.pos
    reader.pos += 1   # [
    negated = reader.peek() == "^"
    if negated:
        reader.pos += 1
    parts = []
    while reader.peek() != "]":
        low = _char(reader, "]")
        if reader.peek() == "-" and reader.peek(2)[1:] not in ("]", ""):   # a range, not a trailing "-"
            reader.pos += 1
            high = _char(reader, "]")
            if ord(high) < ord(low):
                raise reader.error(f"the range {low!r}-{high!r} is backwards", start)
            parts.append(_hex(low) + "-" + _hex(high))
        else:
            parts.append(_hex(low))
    reader.pos += 1
    if not parts:
        if negated:
            return "/(?s:.)/"
        raise reader.error("an empty character class matches nothing", start)
    return "/[" + ("^" if negated else "") + "".join(parts) + "]/"


def _repeat(reader):
    match = _REPEAT.match(reader.text, reader.pos)
    if not match:
        raise reader.error("a repetition is {m}, {m,}, {m,n} or {,n}")
    low, comma, high = match.groups()
    if not low and not comma:
        raise reader.error("{} needs a count")
    low_n = int(low) if low else 0
    high_n = int(high) if high else None
    if max(low_n, high_n or 0) > MAX_REPEAT:
        raise reader.error(f"repetition counts are at most {MAX_REPEAT}")
    if high_n is not None and high_n < low_n:
        raise reader.error(f"{{{low_n},{high_n}}}: the most is below the least")
    reader.pos = match.end()
    if not comma:
        return "{%d}" % low_n
    if high_n is None:
        return "{%d,}" % low_n
    return "{%d,%d}" % (low_n, high_n)


class _Translator:
    def __init__(self, text):
        self.reader = _Reader(text)
        self.names = {}        # GBNF name -> Lark name
        self.used = {}         # GBNF name -> position of its first use (for an undefined rule's error)

    def name(self, gbnf_name):
        if gbnf_name not in self.names:
            base = "r_" + re.sub(r"[^a-z0-9_]", "_", gbnf_name.lower())
            candidate, n = base, 1
            while candidate in self.names.values():
                n += 1
                candidate = f"{base}_{n}"
            self.names[gbnf_name] = candidate
        return self.names[gbnf_name]

    def rules(self):
        reader = self.reader
        out, defined = [], {}
        reader.skip_space(True)
        while not reader.at_end():
            match = _NAME.match(reader.text, reader.pos)
            if not match:
                raise reader.error("expected a rule name")
            name = match.group()
            reader.pos = match.end()
            reader.skip_space(False)
            if reader.peek(3) != "::=":
                raise reader.error(f"expected ::= after the rule name {name!r}")
            reader.pos += 3
            reader.skip_space(True)
            body = self.alternatives(nested=False)
            if name in defined:
                out[defined[name]] = out[defined[name]] + " | " + body   # llama.cpp appends a repeated rule's alternatives
            else:
                defined[name] = len(out)
                out.append(body)
            reader.skip_space(False)
            if not reader.at_end() and reader.peek() not in "\r\n":
                raise reader.error("expected the end of the line after the rule")
            reader.skip_space(True)
        if "root" not in defined:
            raise reader.error("the grammar has no root rule", 0)
        for name, pos in self.used.items():
            if name not in defined:
                raise reader.error(f"the rule {name!r} is used but not defined", pos)
        lines = [f"start: {self.name('root')}"]
        lines += [f"{self.name(name)}: {out[index]}" for name, index in defined.items()]
        return "\n".join(lines) + "\n"

    def alternatives(self, nested):
        reader = self.reader
        options = [self.sequence(nested)]
        while reader.peek() == "|":
            reader.pos += 1
            reader.skip_space(True)
            options.append(self.sequence(nested))
        return " | ".join(options)

    def sequence(self, nested):
        reader = self.reader
        items = []
        while not reader.at_end():
            char = reader.peek()
            start = reader.pos
            if char == '"':
                item = _literal(reader)
            elif char == "[":
                item = _class(reader)
            elif char == ".":
                reader.pos += 1
                item = "/(?s:.)/"
            elif char == "(":
                reader.pos += 1
                reader.skip_space(True)
                inner = self.alternatives(nested=True)
                if reader.peek() != ")":
                    raise reader.error("expected ) to close the group opened", start)
                reader.pos += 1
                item = f"({inner})"
            elif char in "<!":
                raise reader.error("token references (<[id]>, <token>, !...) are not supported here")
            else:
                match = _NAME.match(reader.text, reader.pos)
                if not match:
                    break
                # a name followed by ::= starts the next rule (a rule may end without a blank line)
                after = reader.text[match.end():].lstrip(" \t")
                if after.startswith("::="):
                    break
                reader.pos = match.end()
                self.used.setdefault(match.group(), start)
                item = self.name(match.group())
            reader.skip_space(nested)
            while reader.peek() in ("*", "+", "?", "{"):
                if reader.peek() == "{":
                    suffix = _repeat(reader)
                else:
                    suffix = reader.peek()
                    reader.pos += 1
                if item[-1] in "*+?}":   # a repetition of a repetition: group the first
                    item = f"({item})"
                item += suffix
                reader.skip_space(nested)
            items.append(item)
        return " ".join(items) if items else '""'


def to_lark(text):
    """The llguidance Lark grammar of GBNF `text`; GrammarError (a ValueError) naming the line and
    column of what it cannot read."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar is empty")
    return _Translator(text).rules()
