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
    monkeypatch.setattr(compare, "cpu_has_amx", lambda: has_amx)
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


def test_cpu_has_amx_reads_this_machines_flags(compare):
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert compare.cpu_has_amx() == ("amx_tile" in flags)
