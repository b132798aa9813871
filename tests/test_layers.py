"""The walls between the Python layers (docs/architecture.md, "The Python side"), read from the
imports of each module, so a shortcut through a wall fails here rather than in a review."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "krafla_twisted"


def imported(path):
    """Every krafla_twisted module a file imports (at the top or inside a function)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("krafla_twisted")}


ENGINE_SIDE = {f"krafla_twisted.{name}" for name in ("clib", "header", "engine", "tokenizer", "sampler", "pack",
                                                      "container", "kernels", "models", "options", "startup")}


class LayerTests:
    @pytest.mark.parametrize("path", sorted((PACKAGE / "api").glob("*.py")), ids=lambda p: p.name)
    def test_api_reaches_the_engine_only_through_the_backend(self, path):
        """No module of api/ but backend.py imports the engine's bindings, the C library, the option table
        or the downloader; backend.py itself goes through generate and engine only."""
        reached = imported(path) & ENGINE_SIDE
        if path.name == "backend.py":
            assert reached <= {"krafla_twisted.engine"}, reached
        else:
            assert not reached, reached

    def test_generate_knows_no_options_and_no_downloads(self):
        """generate.py imports neither the option table, the start-up module nor the model downloader."""
        reached = imported(PACKAGE / "generate.py")
        assert not reached & {"krafla_twisted.options", "krafla_twisted.models", "krafla_twisted.startup"}, reached

    def test_the_walls_are_seen(self):
        """The import reader sees what it should: startup.py reaches options, models and the engine."""
        assert {"krafla_twisted.options", "krafla_twisted.models", "krafla_twisted.engine"} <= imported(PACKAGE / "startup.py")
