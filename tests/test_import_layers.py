"""The walls between the Python layers (docs/architecture.md, "The Python side"), checked by
import-linter from the contracts in .importlinter, so a shortcut through a wall fails here rather
than in a review.

From the bottom: engine < chat < generation | convert < api | cli < tap. A layer imports only the
layers below it ('|' separates siblings that may not import each other), and api/ never imports
ctypes, numpy or engine/, even though the layers below it do. Each planted import below breaks one
contract in a copy of the package, so the checker is seen to see it.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "krafla_twisted"
LAYERS = ("engine", "chat", "generation", "convert", "api", "cli")
LAYERS_CONTRACT = "krafla_twisted's layers: imports only go down"
API_CONTRACT = "api/ never touches ctypes, numpy or the engine"


def lint(tree):
    """lint-imports on the package under `tree` (with the repository's contracts): (exit status, report)."""
    command = [str(pathlib.Path(sys.executable).with_name("lint-imports")), "--config", str(ROOT / ".importlinter"),
               "--no-cache"]
    done = subprocess.run(command, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


class ImportLayerTests:
    def test_the_package_keeps_its_layers(self):
        status, report = lint(ROOT)
        assert status == 0, report
        assert "Contracts: 2 kept, 0 broken." in report, report

    def test_every_module_is_in_a_layer(self):
        """Nothing but __init__.py and tap.py sits at the package's root: a module dropped there would be
        outside every layer, and the contracts would not see it."""
        assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py", "tap.py"}
        assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(LAYERS)

    @pytest.mark.parametrize("layer", LAYERS)
    def test_each_layer_says_what_it_holds_and_may_import(self, layer):
        """Each layer's __init__.py has a docstring naming every module in it and what it may import."""
        doc = (PACKAGE / layer / "__init__.py").read_text()
        assert doc.startswith('"""') and "import" in doc
        modules = {p.stem for p in (PACKAGE / layer).glob("*.py")} - {"__init__"}
        assert [m for m in modules if m not in doc] == []

    @pytest.mark.parametrize("module, planted, contract, reported", [
        # an upward import, at the top of the file
        ("engine/header.py", "from krafla_twisted.cli import options", LAYERS_CONTRACT,
         "krafla_twisted.engine.header -> krafla_twisted.cli.options"),
        # an upward import inside a function is an import too
        ("chat/templates.py", "def _late():\n    from krafla_twisted.generation import tools\n", LAYERS_CONTRACT,
         "krafla_twisted.chat.templates -> krafla_twisted.generation.tools"),
        # siblings of one layer do not import each other
        ("generation/tools.py", "from krafla_twisted.convert import gguf", LAYERS_CONTRACT,
         "krafla_twisted.generation.tools -> krafla_twisted.convert.gguf"),
        ("cli/info.py", "from krafla_twisted.api import errors", LAYERS_CONTRACT,
         "krafla_twisted.cli.info -> krafla_twisted.api.errors"),
        # api/ is above engine/, yet may not import it, nor ctypes or numpy
        ("api/sse.py", "from krafla_twisted.engine import clib", API_CONTRACT,
         "krafla_twisted.api.sse -> krafla_twisted.engine.clib"),
        ("api/errors.py", "import ctypes", API_CONTRACT, "krafla_twisted.api.errors -> ctypes"),
        ("api/schema.py", "import numpy as np", API_CONTRACT, "krafla_twisted.api.schema -> numpy"),
    ])
    def test_a_planted_import_breaks_its_contract(self, tmp_path, module, planted, contract, reported):
        shutil.copytree(PACKAGE, tmp_path / "krafla_twisted", ignore=shutil.ignore_patterns("_native", "__pycache__"))
        with open(tmp_path / "krafla_twisted" / module, "a") as f:
            f.write("\n" + planted + "\n")
        status, report = lint(tmp_path)
        assert status != 0, report
        assert "Contracts: 1 kept, 1 broken." in report, report
        broken = report.split("Broken contracts", 1)[1]
        assert contract in broken and reported in broken, report
