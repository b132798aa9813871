"""krafla_twisted/engine/header.py: the constants of krafla.h, read from the header, and what the built
library says about them.

Independent checks: a plain scan of the header text for every KR_ name it defines, and the C
library itself (kr_type_name, kr_session_new's defaults and the KV types it accepts).
"""

import re

import pytest

from krafla_twisted.cli import options
from krafla_twisted.engine import formats, header, kernels, pack
from krafla_twisted.engine.model import KV_TYPES, EngineError, Model
from tests.support.tiny_models import write_tiny_model


class ParseTests:
    """The parser reads what a C compiler would, and refuses what it cannot read."""

    def test_every_constant_of_krafla_h_is_read(self):
        """Each `#define KR_...` with a value and each enum member named in the header is an attribute."""
        text = open(header.PATH, encoding="utf-8").read()
        code = re.sub(r"//[^\n]*", "", text)
        defined = set(re.findall(r"^\s*#define\s+(KR_\w+)\s+\S", code, re.M))
        enum_bodies = re.findall(r"typedef\s+enum\s*\{([^}]*)\}", code)
        members = {m for body in enum_bodies for m in re.findall(r"\b(KR_\w+)\s*(?:=|,|$)", body)}
        assert defined and members
        assert defined | members == set(header.CONSTANTS)

    def test_values(self):
        """Literals with suffixes, shifts, references to earlier names, implicit enum values, strings."""
        constants, enums = header.parse(
            '#define KR_A 3\n#define KR_B (1u << 4) // sixteen\n#define KR_S "KRAFLA"\n'
            "/* a comment { } */ typedef enum { KR_X = KR_A, KR_Y, KR_Z = KR_B | 1, } kr_thing;\n")
        assert constants == {"KR_A": 3, "KR_B": 16, "KR_S": "KRAFLA", "KR_X": 3, "KR_Y": 4, "KR_Z": 17}
        assert enums == {"kr_thing": {"KR_X": 3, "KR_Y": 4, "KR_Z": 17}}

    @pytest.mark.parametrize("text", ["#define KR_A sizeof(int)\n", "#define KR_A KR_UNDEFINED\n",
                                      "typedef enum { KR_A = 1.5 } kr_bad;\n", "#define KR_A (1 <<\n"])
    def test_unreadable_constant_is_an_error_naming_the_line(self, text):
        """A constant the parser cannot evaluate raises HeaderError with file:line, never a gap."""
        with pytest.raises(header.HeaderError, match=r"test\.h:1: cannot read"):
            header.parse(text, "test.h")


class LibraryAgreesTests:
    """The header's constants are what the compiled library does."""

    def test_type_names(self):
        """kr_type_name(code) of every kr_type member is its name in formats.py."""
        from krafla_twisted.engine import container

        types = {k: v for k, v in header.ENUMS["kr_type"].items() if k != "KR_TYPE_COUNT"}
        assert set(types.values()) == set(formats.TENSOR_TYPES)
        for name, code in types.items():
            assert container.type_name(code) == formats.TENSOR_TYPES[code].name == name[3:].lower().replace("_k", "_K")

    def test_default_context_and_kv_types(self, tmp_path):
        """A session without a context gets min(max_seq, KR_DEFAULT_MAX_CTX); every KR_KV_ type is
        accepted, and the other weight types are refused."""
        long_model, short_model = tmp_path / "long.mlb", tmp_path / "short.mlb"
        write_tiny_model(long_model, "llama", seed=1, max_seq=header.KR_DEFAULT_MAX_CTX + 100)
        write_tiny_model(short_model, "llama", seed=1, head_dim=32, max_seq=100)
        with Model(long_model) as model:
            assert model.session().n_ctx == header.KR_DEFAULT_MAX_CTX
        with Model(short_model) as model:
            assert model.session().n_ctx == 100
            for name in KV_TYPES:
                assert model.session(kv=name).kv == name
            for code in set(formats.TENSOR_TYPES) - set(KV_TYPES.values()):
                KV_TYPES["other"] = code
                try:
                    with pytest.raises(EngineError, match="KV cache type"):
                        model.session(kv="other")
                finally:
                    del KV_TYPES["other"]

    def test_python_tables_come_from_the_header(self):
        """The option table, the pack status names and the kernel implementations list the header's members."""
        assert options.KV_TYPES == tuple(KV_TYPES) == ("f32", "f16", "q8_0")
        assert set(pack.STATUS_NAMES) == set(header.ENUMS["kr_pack_status"].values())
        assert kernels.IMPLEMENTATIONS["dispatch"] == header.KR_KERNEL_DISPATCH
        assert f"at most {header.KR_DEFAULT_MAX_CTX}" in options.BY_NAME["ctx"].help
