"""bench/compare.py's choice of llama.cpp's build options: the `native` peer leaves AMX out where the
CPU has it (its AMX matmuls fault in this llama.cpp), and nothing else changes; and its read
roofline, bench/stream_read.c, built afresh for every run and checked against the buffer it reads.
Builds no llama.cpp (the script itself is run by hand: bench/README.md)."""

import json
import subprocess

import numpy as np
import pytest

from krafla_twisted.engine import clib
from tests.support.bench import bench_module


@pytest.fixture(scope="module")
def compare():
    """bench/compare.py as a module."""
    with bench_module("compare") as module:
        yield module


@pytest.mark.parametrize("has_amx", [False, True])
def test_native_peer_leaves_amx_out_only_where_the_cpu_has_it(compare, monkeypatch, has_amx):
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
    assert compare.leaves_out_amx("native") == ("amx_tile" in clib.cpu_flags())
    assert not compare.leaves_out_amx("avx2")


def buffer_fold(n_bytes, threads):
    """What bench/stream_read.c's loops must fold from its buffer: the XOR of every 64-bit word of
    each thread's slice (byte i of the buffer is bits 24-31 of i * 2654435761)."""
    index = np.arange(n_bytes, dtype=np.uint64)
    buffer = ((index * np.uint64(2654435761)) >> np.uint64(24)).astype(np.uint8)
    per = (n_bytes // threads) & ~127
    return np.bitwise_xor.reduce(buffer[: per * threads].view(np.uint64))


@pytest.mark.parametrize("threads", [1, 3])
def test_the_roofline_reader_is_built_afresh_and_both_its_loops_read_every_byte(compare, tmp_path, threads):
    # a binary left by another command (here one that claims a roofline no memory gives), newer than
    # the source: it must not stand in for the roofline
    stale = tmp_path / "roofline" / "stream_read"
    stale.parent.mkdir()
    stale.write_text('#!/bin/sh\necho \'{"gb_per_s": 1000000.0}\'\n')
    stale.chmod(0o755)
    binary = compare.stream_reader(tmp_path)
    mib = 5  # at three threads, slices that end in part of a 256-byte step: the indexed loop's tail
    out = json.loads(subprocess.run([str(binary), str(threads), str(mib)], check=True, capture_output=True,
                                    text=True).stdout)
    assert 0 < out["gb_per_s"] < 1e5
    assert int(out["check"], 16) == buffer_fold(mib << 20, threads)
    if "avx2" in clib.cpu_flags():
        assert int(out["indexed_check"], 16) == buffer_fold(mib << 20, threads)
        assert out["gb_per_s"] == max(out["compiler_loop_gb_per_s"], out["indexed_loop_gb_per_s"])
    else:
        assert "indexed_check" not in out and out["gb_per_s"] == out["compiler_loop_gb_per_s"]
    # with arithmetic per vector (WORK) only the compiler's loop runs
    worked = json.loads(subprocess.run([str(binary), "1", "4", "2"], check=True, capture_output=True, text=True).stdout)
    assert "indexed_loop_gb_per_s" not in worked and worked["gb_per_s"] == worked["compiler_loop_gb_per_s"]
