"""The constants of krafla.h, read from the header itself so that Python never restates them.

    from krafla_twisted.engine import header
    header.KR_ERR_ARGUMENT                 # 4
    header.members("KR_PACK_STATUS_")      # {"NONE": 0, "MEMORY": 1, "CACHE_MAPPED": 2, "CACHE_BUILT": 3}
    header.ENUMS["kr_type"]                # {"KR_F32": 0, "KR_F16": 1, ...}

Every `#define KR_NAME value` (an integer expression or a string) and every member of a `typedef
enum { ... } name;` becomes a module attribute. The header is the one in the source tree
(engine_c/include/krafla.h) or, in an installed package, the copy setup.py puts beside the library
(krafla_twisted/_native/krafla.h). Anything the parser does not understand is an error naming the
line, never a silent gap.
"""

import ast
import operator
import os
import re

# krafla_twisted/, one level above this engine/ folder: _native/ sits in it, the source tree above it.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = (
    os.path.join(os.path.dirname(PACKAGE_DIR), "engine_c", "include", "krafla.h"),
    os.path.join(PACKAGE_DIR, "_native", "krafla.h"),
)

_OPERATORS = {ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
              ast.BitAnd: operator.and_, ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class HeaderError(Exception):
    """krafla.h is missing or holds a constant this parser cannot read."""


def header_path():
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    raise HeaderError(f"krafla.h not found (looked in {', '.join(CANDIDATES)})")


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _evaluate(expression, known, where):
    """An integer constant expression of C (literals with u/l suffixes, names already defined,
    + - * << >> | & and parentheses)."""
    source = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expression.strip())

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and isinstance(known.get(node.id), int):
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise HeaderError(f"{where}: cannot read the constant {expression.strip()!r}")

    try:
        return walk(ast.parse(source, mode="eval"))
    except SyntaxError:
        raise HeaderError(f"{where}: cannot read the constant {expression.strip()!r}") from None


def parse(text, name="krafla.h"):
    """({constant: value}, {enum type name: {member: value}}) of a header's text."""
    text = _strip_comments(text)
    constants, enums = {}, {}
    for match in re.finditer(r"^[ \t]*#define[ \t]+(KR_\w+)[ \t]+([^\n]+)$", text, re.M):
        key, value = match.group(1), match.group(2).strip()
        where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
        if value.startswith('"'):
            constants[key] = ast.literal_eval(value)
        else:
            constants[key] = _evaluate(value, constants, where)
    for match in re.finditer(r"typedef\s+enum\s*\{([^}]*)\}\s*(\w+)\s*;", text):
        body, enum_name = match.group(1), match.group(2)
        where = f"{name}:{text.count(chr(10), 0, match.start()) + 1}"
        members, following = {}, 0
        for item in (part.strip() for part in body.split(",")):
            if not item:
                continue
            member, _, expression = (piece.strip() for piece in item.partition("="))
            if not re.fullmatch(r"\w+", member):
                raise HeaderError(f"{where}: cannot read the enum member {item!r} of {enum_name}")
            value = _evaluate(expression, {**constants, **members}, where) if expression else following
            members[member] = value
            following = value + 1
        enums[enum_name] = members
        constants.update(members)
    return constants, enums


def members(prefix):
    """{name without prefix: value} of every constant whose name starts with `prefix`, in header order."""
    return {key[len(prefix):]: value for key, value in CONSTANTS.items() if key.startswith(prefix)}


PATH = header_path()
with open(PATH, encoding="utf-8") as _file:
    CONSTANTS, ENUMS = parse(_file.read(), PATH)
globals().update(CONSTANTS)
