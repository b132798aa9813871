"""bench/compare.py's choice of llama.cpp's build options: the `native` peer leaves AMX out where the
CPU has it (its AMX matmuls fault in this llama.cpp), and nothing else changes. Builds nothing (the
script itself is run by hand: bench/README.md)."""

import pytest

from tests.support.bench import bench_module


@pytest.fixture(scope="module")
def compare():
    """bench/compare.py as a module."""
    with bench_module("compare") as module:
        yield module


@pytest.mark.parametrize("has_amx", [False, True])
def test_native_peer_leaves_amx_out_only_where_the_cpu_has_it(compare, monkeypatch, has_amx):
    from krafla_twisted.engine import clib

    monkeypatch.setattr(clib, "cpu_flags", lambda: {"avx2", "avx512f"} | ({"amx_tile"} if has_amx else set()))
    native = compare.llama_cmake("native")
    assert native[: len(compare.LLAMA_CMAKE["native"])] == compare.LLAMA_CMAKE["native"]
    extra = native[len(compare.LLAMA_CMAKE["native"]):]
    if has_amx:
        assert extra == ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                         "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
    else:
        assert extra == []
    # the AVX2 peer is the same build on every CPU
    assert compare.llama_cmake("avx2") == compare.LLAMA_CMAKE["avx2"]


def test_only_the_native_build_of_an_amx_cpu_leaves_amx_out(compare):
    from krafla_twisted.engine import clib

    assert compare.leaves_out_amx("native") == ("amx_tile" in clib.cpu_flags())
    assert not compare.leaves_out_amx("avx2")
