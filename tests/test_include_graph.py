"""engine_c's #include graph: no file includes itself through others, and each folder of
engine_c/src includes only its own headers and those of the folders below it (docs/architecture.md,
"Layout").

Plain text, no compiler: every `#include "..."` line of engine_c's .c and .h files, inside #if
blocks too, resolved as the Makefile's -I flags resolve it (the including file's folder, then
engine_c/src, then engine_c/include). The checker runs on small planted trees too, so a broken
parser cannot pass by finding nothing.
"""

import re
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine_c"

# engine_c/src's folders from the bottom up: a file includes the headers of its own folder and of
# the folders before it. Folders in one tuple are peers, and neither includes the other.
# engine_c/include/krafla.h, the public API, is below them all.
LAYERS = ("runtime", "types", "format", "kernels", ("tokenizer", "sampler"), "model")

INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def include_graph(engine):
    """{file: [files it includes]} for every .c and .h under `engine`, paths relative to it.
    ValueError when an include names no file."""
    search = [engine / "src", engine / "include"]
    graph = {}
    for path in sorted(p for p in engine.rglob("*") if p.suffix in (".c", ".h")):
        included = []
        for name in INCLUDE.findall(path.read_text(encoding="utf-8")):
            found = next((folder / name for folder in [path.parent, *search] if (folder / name).is_file()), None)
            if found is None:
                raise ValueError(f'{path.relative_to(engine)}: #include "{name}" is not a file')
            included.append(found.resolve().relative_to(engine.resolve()))
        graph[path.relative_to(engine)] = included
    return graph


def find_cycle(graph):
    """Files each including the next, the last one the first again (so it appears twice), or None."""
    done, path, on_path = set(), [], set()

    def visit(node):
        path.append(node)
        on_path.add(node)
        for target in graph.get(node, ()):
            if target in on_path:
                return path[path.index(target):] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(node)
        return None

    for node in graph:
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def layer_problems(graph, layers):
    """What breaks the layer order: a file of src/ outside the layers' folders, or an include of
    a folder of src/ that is not below the including file's folder."""
    rank = {}
    for position, layer in enumerate(layers):
        for folder in layer if isinstance(layer, tuple) else (layer,):
            rank[folder] = position

    def folder_of(path):
        return path.parts[1] if path.parts[0] == "src" and len(path.parts) == 3 else None

    problems = []
    for source, targets in sorted(graph.items()):
        if source.parts[0] != "src":
            continue
        folder = folder_of(source)
        if folder not in rank:
            problems.append(f"{source}: not in a folder of the layers {layers}")
            continue
        for target in targets:
            other = folder_of(target)
            if other is None and target.parts[0] == "src":
                problems.append(f"{source} includes {target}, which is not in a folder of the layers")
            elif other is not None and other != folder and not rank.get(other, len(layers)) < rank[folder]:
                problems.append(f"{source} includes {target}: {other}/ is not below {folder}/")
    return problems


def plant(engine, files):
    """Write {relative path: text} under engine."""
    for name, text in files.items():
        path = engine / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


class EngineTests:
    """The real engine_c."""

    def test_no_include_cycle(self):
        """No file of engine_c includes itself, directly or through other headers."""
        graph = include_graph(ENGINE)
        assert sum(map(len, graph.values())) > 50  # the parser found the includes
        cycle = find_cycle(graph)
        assert cycle is None, "include cycle: " + " -> ".join(map(str, cycle))

    def test_folders_include_only_lower_layers(self):
        """Each folder of engine_c/src includes its own headers, the lower layers' and krafla.h only."""
        graph = include_graph(ENGINE)
        assert {path.parts[1] for path in graph if path.parts[0] == "src"} > {"runtime", "kernels", "model"}
        assert layer_problems(graph, LAYERS) == []


class CheckerTests:
    """The checker on planted trees: it finds what it looks for."""

    def test_planted_cycle(self, tmp_path):
        """Three headers including each other in a circle, one of them by a relative name."""
        plant(tmp_path, {"src/a/one.h": '#include "a/two.h"\n', "src/a/two.h": '#include "b/three.h"\n',
                         "src/b/three.h": '#if X\n#  include "../a/one.h"\n#endif\n', "src/b/main.c": '#include "b/three.h"\n'})
        cycle = find_cycle(include_graph(tmp_path))
        assert cycle is not None and cycle[0] == cycle[-1]
        assert sorted(map(str, cycle[:-1])) == ["src/a/one.h", "src/a/two.h", "src/b/three.h"]

    def test_self_include(self, tmp_path):
        """A header that includes itself is the shortest cycle."""
        plant(tmp_path, {"src/a/one.h": '#include "one.h"\n'})
        assert list(map(str, find_cycle(include_graph(tmp_path)))) == ["src/a/one.h", "src/a/one.h"]

    def test_diamond_is_no_cycle(self, tmp_path):
        """Two headers including the same lower one, and both included by one file: no cycle."""
        plant(tmp_path, {"src/a/low.h": "", "src/a/left.h": '#include "a/low.h"\n', "src/a/right.h": '#include "low.h"\n',
                         "src/a/top.c": '#include "a/left.h"\n#include "a/right.h"\n#include "api.h"\n',
                         "include/api.h": ""})
        graph = include_graph(tmp_path)
        assert graph[Path("src/a/top.c")] == [Path("src/a/left.h"), Path("src/a/right.h"), Path("include/api.h")]
        assert find_cycle(graph) is None

    def test_next_to_the_file_first(self, tmp_path):
        """A name is looked up beside the including file before src/ and include/, as the compiler does."""
        plant(tmp_path, {"src/a/x.h": "", "src/x.h": "", "include/x.h": "", "src/a/main.c": '#include "x.h"\n',
                         "src/b/main.c": '#include "x.h"\n', "src/b/api.c": '#include "y.h"\n', "include/y.h": ""})
        graph = include_graph(tmp_path)
        assert graph[Path("src/a/main.c")] == [Path("src/a/x.h")]
        assert graph[Path("src/b/main.c")] == [Path("src/x.h")]
        assert graph[Path("src/b/api.c")] == [Path("include/y.h")]

    def test_missing_include(self, tmp_path):
        """An include that names no file is an error, not an edge left out."""
        plant(tmp_path, {"src/a/main.c": '#include "a/gone.h"\n'})
        with pytest.raises(ValueError, match='src/a/main.c: #include "a/gone.h"'):
            include_graph(tmp_path)

    def test_planted_upward_include(self, tmp_path):
        """A lower folder including a higher one's header, peers including each other, and a folder
        the layers do not name are each reported; downward, own-folder and API includes are not."""
        plant(tmp_path, {"include/api.h": "",
                         "src/low/low.h": "", "src/low/low.c": '#include "low/low.h"\n#include "api.h"\n',
                         "src/low/bad.c": '#include "high/high.h"\n',
                         "src/left/left.h": '#include "right/right.h"\n', "src/right/right.h": '#include "low/low.h"\n',
                         "src/high/high.h": '#include "low/low.h"\n#include "left/left.h"\n',
                         "src/extra/extra.c": '#include "low/low.h"\n'})
        problems = layer_problems(include_graph(tmp_path), ("low", ("left", "right"), "high"))
        assert len(problems) == 3, problems
        assert problems[0].startswith("src/extra/extra.c: not in a folder of the layers")
        assert problems[1] == "src/left/left.h includes src/right/right.h: right/ is not below left/"
        assert problems[2] == "src/low/bad.c includes src/high/high.h: high/ is not below low/"
