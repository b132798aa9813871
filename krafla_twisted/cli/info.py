"""`krafla info FILE.mlb|FILE.mlt`: a file's metadata and tensor table, read by the C loader.

The loader validates the whole file first, so a truncated, corrupted or hostile file prints
the loader's message (naming the file and the problem) and exits with status 1.
"""

import json
import math
import os
import sys

from krafla_twisted.engine import clib
from krafla_twisted.engine.container import MODEL_MAGIC, TOKENIZER_MAGIC, ContainerFile

KINDS = {MODEL_MAGIC: "model", TOKENIZER_MAGIC: "tokenizer"}
SHOWN_ARRAY_VALUES = 16  # longer arrays print their first values and their length


def add_arguments(parser):
    parser.add_argument("files", nargs="+", metavar="FILE", help="a .mlb model or .mlt tokenizer file")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per file: magic, size, metadata, tensors")


def printable(text):
    """`text` with control and other unprintable characters escaped, so a hostile name cannot
    drive the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


SHOWN_STRING_CHARS = 100  # longer strings (a .mlt's chat_template_jinja) are cut in the text report


def format_value(value):
    if isinstance(value, str):
        if len(value) > SHOWN_STRING_CHARS:
            return json.dumps(value[:SHOWN_STRING_CHARS], ensure_ascii=False) + f"... ({len(value)} characters)"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        shown = ", ".join(format_value(v) for v in value[:SHOWN_ARRAY_VALUES])
        if len(value) > SHOWN_ARRAY_VALUES:
            return f"[{shown}, ...] ({len(value)} values)"
        return f"[{shown}]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_shape(shape):
    return " x ".join(str(d) for d in shape)


def describe(file, out):
    """Print the text report of one opened ContainerFile to `out`."""
    kind = KINDS.get(file.magic, "unknown")
    print(f"{file.path}: krafla {kind} file ({file.magic.decode('ascii', 'replace')}), {file.size} bytes, "
          f"{len(file.metadata)} metadata entries, {len(file.tensors)} tensors", file=out)
    if file.metadata:
        print("\nmetadata", file=out)
        width = max(len(printable(key)) for key in file.metadata)
        for key, value in file.metadata.items():
            print(f"  {printable(key):<{width}}  {printable(format_value(value))}", file=out)
    if file.tensors:
        print("\ntensors", file=out)
        rows = [(printable(name), type_name, format_shape(shape), str(n_bytes))
                for name, type_name, shape, n_bytes in file.tensors]
        header = ("name", "type", "shape", "bytes")
        widths = [max(len(row[i]) for row in rows + [header]) for i in range(4)]
        for row in [header] + rows:
            print(f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}",
                  file=out)
        by_type = {}
        for _, type_name, shape, n_bytes in file.tensors:
            count, total = by_type.get(type_name, (0, 0))
            by_type[type_name] = (count + 1, total + n_bytes)
        elements = sum(math.prod(shape) for _, _, shape, _ in file.tensors)
        types = ", ".join(f"{name} {count}" for name, (count, _) in sorted(by_type.items()))
        print(f"\n  {len(file.tensors)} tensors ({types}), {elements} elements, "
              f"{sum(total for _, total in by_type.values())} bytes", file=out)


def as_json(file):
    return {
        "path": str(file.path),
        "magic": file.magic.decode("ascii", "replace"),
        "size": file.size,
        "metadata": file.metadata,
        "tensors": [{"name": name, "type": type_name, "shape": list(shape), "bytes": n_bytes}
                    for name, type_name, shape, n_bytes in file.tensors],
    }


def main(args, out=None, err=None):
    try:
        return report(args, out or sys.stdout, err or sys.stderr)
    except BrokenPipeError:
        # The reader went away (`krafla info x.mlb | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def report(args, out, err):
    status = 0
    for index, path in enumerate(args.files):
        try:
            with ContainerFile(path) as file:
                if args.json:
                    print(json.dumps(as_json(file), ensure_ascii=False), file=out)
                else:
                    if index:
                        print(file=out)
                    describe(file, out)
        except clib.KraflaError as e:
            print(f"krafla info: {printable(str(e))}", file=err)
            status = 1
    return status
