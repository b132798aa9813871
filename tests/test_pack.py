"""Weight repacking (engine_c/src/model/pack.c, the packed kernels) and the packed-weight cache.

Pinned here: the packed layout byte for byte against a numpy construction of what kernels.h
describes; packed matmuls equal the file-layout matmuls bit for bit (every implementation, any
row range); a row looked up in a packed matrix is gguf-py's dequantized row; a model's logits are
the same bits packed or not, and a tied embedding is looked up without reading the file again; the cache is used when it matches
and rebuilt, never trusted, when it is stale (another model file, ISA or layout version),
truncated or corrupt.
"""

import os
import shutil

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings, strategies as st

from krafla_twisted.engine import kernels, pack
from krafla_twisted.engine.model import Model
from tests.support import kquants
from tests.support.tiny_models import write_tiny_model, write_tiny_models
from tests.test_kernels import avx2_or_skip, make_problem, random_float32, same_bits
from tests.test_quant_types import PACKED as LOW_BIT
from tests.test_quant_types import random_blocks as low_bit_blocks

BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
PACKABLE = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K", "iq4_nl", "mxfp4")
PACK_ROWS = 8
HEADER_BYTES = 4096


def numpy_packed(type_name, data, rows, cols):
    """The packed layout built with numpy from kernels.h's description: whole groups of 8 rows where
    they are in the file, the rows past the last group as they are; in a group, block by block, the
    8 rows' f16 scales, then chunks of 4 quant bytes from each row (chunk i: bytes 4i..4i+3)."""
    block = BLOCK_BYTES[type_name]
    n_blocks = cols // 32
    blocks = data.reshape(rows, n_blocks, block)
    grouped = rows - rows % PACK_ROWS
    out = []
    for first in range(0, grouped, PACK_ROWS):
        group = blocks[first:first + PACK_ROWS]  # (8, n_blocks, block)
        for b in range(n_blocks):
            out.append(group[:, b, :2].reshape(-1))
            quants = group[:, b, 2:].reshape(PACK_ROWS, -1, 4)  # (row, chunk, byte)
            out.append(quants.transpose(1, 0, 2).reshape(-1))
    out.append(blocks[grouped:].reshape(-1))
    return np.concatenate(out)


@st.composite
def packed_problems(draw):
    type_name = draw(st.sampled_from(("q8_0", "q4_0")))
    rows = draw(st.integers(1, 27))
    cols = 32 * draw(st.integers(1, 6))
    n_tokens = draw(st.integers(1, 9))
    row_begin = draw(st.integers(0, rows - 1))
    row_end = draw(st.integers(row_begin + 1, rows))
    return type_name, rows, cols, n_tokens, row_begin, row_end, draw(st.integers(0, 2**32 - 1))


class PackedKernelTests:
    @given(packed_problems())
    @settings(max_examples=60, deadline=None)
    def test_layout_matches_the_documented_one(self, problem):
        """kr_pack_rows writes exactly the layout kernels.h describes (built independently in numpy)."""
        type_name, rows, cols, n_tokens, _, _, seed = problem
        w, _x = make_problem(type_name, rows, cols, n_tokens, seed)
        got = kernels.pack(type_name, w, rows, cols)
        assert np.array_equal(got, numpy_packed(type_name, w, rows, cols))

    @pytest.mark.parametrize("impl", ["reference", "avx2", "dispatch"])
    @given(problem=packed_problems())
    @settings(max_examples=60, deadline=None)
    def test_packed_matmul_equals_file_layout_bit_for_bit(self, impl, problem):
        """Every implementation gives the same bits on packed weights as the reference on the file
        layout, for any row range (ranges that start or end inside a group of 8, and the rows past the last group, included)."""
        if impl == "avx2":
            avx2_or_skip()
        type_name, rows, cols, n_tokens, row_begin, row_end, seed = problem
        w, x = make_problem(type_name, rows, cols, n_tokens, seed)
        packed = kernels.pack(type_name, w, rows, cols)
        want = kernels.matmul(type_name, w, rows, cols, x, impl="reference")
        got = kernels.matmul_packed(type_name, packed, rows, cols, x, impl=impl, row_begin=row_begin, row_end=row_end)
        assert same_bits(got[:, row_begin:row_end], want[:, row_begin:row_end])
        assert np.isnan(got[:, :row_begin]).all() and np.isnan(got[:, row_end:]).all()

    @given(type_name=st.sampled_from(PACKABLE), rows=st.integers(1, 27),
           blocks=st.one_of(st.integers(1, 3), st.integers(17, 35)), seed=st.integers(0, 2**32 - 1))
    @settings(max_examples=80, deadline=None)
    def test_row_lookup_in_packed_weights_is_the_dequantized_row(self, type_name, rows, blocks, seed):
        """Every row of a packed matrix of every packable type, those in whole groups of 8 and those
        past the last one, short rows and long ones (q4_K's in column slices), looked up as the model
        looks up a tied embedding: gguf-py's dequantized file row, bit for bit."""
        gguf_type = gguf.GGMLQuantizationType[type_name.upper()]
        rng = np.random.default_rng(seed)
        if type_name.endswith("_K"):
            cols = 256 * blocks
            weights = kquants.random_blocks(rng, type_name, rows, cols)
        elif type_name in LOW_BIT:  # random bytes with sane scales (gguf-py has no iq4_nl quantizer)
            cols = 32 * blocks
            weights = low_bit_blocks(rng, type_name, rows, cols)
        else:
            cols = 32 * blocks
            weights = gguf_quantize(random_float32(rng, (rows, cols)), gguf_type)
        weights = np.ascontiguousarray(weights, np.uint8).reshape(rows, -1)
        with np.errstate(over="ignore"):  # mxfp4's largest exponents overflow float32, in both
            want = gguf_dequantize(weights, gguf_type).astype(np.float32)
        packed = kernels.pack(type_name, weights.reshape(-1), rows, cols)
        for row in range(rows):
            assert same_bits(kernels.dequantize_packed(type_name, packed, rows, cols, row), want[row]), row

    def test_row_lookup_outside_the_matrix_is_refused(self):
        packed = kernels.pack("q4_0", np.zeros(9 * 18, np.uint8), 9, 32)
        for row in (-1, 9):
            with pytest.raises(Exception, match="row"):
                kernels.dequantize_packed("q4_0", packed, 9, 32, row)

    def test_float_weights_are_refused(self):
        """Only the PACKABLE types have a packed layout: packing f32 is an error, not a silent copy."""
        with pytest.raises(Exception, match="q8_0"):
            kernels.pack("f32", np.zeros(4 * 8 * 4, np.uint8), 4, 8)


def resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def mapped_resident_bytes(path):
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                mine = len(fields) >= 6 and fields[5] == str(path)
            elif mine and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def logits(model, tokens, batch):
    with model.session(ctx=64, batch=batch) as session:
        return session.eval(tokens)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return write_tiny_models(tmp_path_factory.mktemp("pack"), ("q4_0", "q8_0", "q4_K", "q5_K", "q6_K"), seed=7)


TOKENS = [3, 17, 5, 60, 2, 9, 41, 33, 12, 7, 50, 1, 28]


class PackedModelTests:
    @pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
    @pytest.mark.parametrize("weight_type", ["q4_0", "q8_0", "q4_K", "q5_K", "q6_K"])
    def test_logits_are_bitwise_identical_packed_or_not(self, tiny_models, arch, weight_type):
        """Packing moves bytes only: the same logits, bit for bit, at batch 1, 5 and the whole prompt."""
        path = tiny_models[arch, weight_type]
        with Model(path, threads=2, pack=False) as plain, Model(path, threads=2, pack=True) as packed:
            assert pack.status(plain)[0] == pack.NOT_PACKED and pack.status(packed)[0] == pack.PACKED_IN_MEMORY
            for batch in (1, 5, len(TOKENS)):
                assert same_bits(logits(plain, TOKENS, batch), logits(packed, TOKENS, batch))

    def test_real_model_is_bitwise_identical_packed_or_not(self, testdata):
        """SmolLM2-135M q4_0: 30 layers of real weights, packed and unpacked, the same bits."""
        from tests.support.real_models import real_model

        path = real_model("smollm2-135m").mlb
        with Model(path, threads=2, pack=False) as plain, Model(path, threads=2, pack=True) as packed:
            assert same_bits(logits(plain, TOKENS, 4), logits(packed, TOKENS, 4))

    @pytest.mark.parametrize("pack_weights", [True, False])
    def test_tied_embedding_is_looked_up_in_the_packed_copy(self, tmp_path, pack_weights):
        """SmolLM2's output head is its token embedding. Packed, a token's row comes from the packed
        copy: the model file's mapping keeps the pages it had after loading while 400 tokens from all
        over the vocabulary are embedded (read from the file, each lookup maps the 64 KiB around its
        row back in: most of the 16 MiB embedding here). Unpacked, the file is the only copy and its
        pages do come in, which shows the measurement sees them."""
        from tests.support.real_models import real_model

        path = tmp_path / "model.mlb"
        shutil.copy(real_model("smollm2-135m").mlb, path)  # a mapping no other model in this process shares
        with Model(path, threads=1, pack=pack_weights) as model:
            assert model.info["tied_embeddings"] == 1
            tokens = list(range(1, model.n_vocab, model.n_vocab // 400))
            with model.session(ctx=512, batch=64) as session:
                before = mapped_resident_bytes(path)
                session.eval(tokens)
                grown = mapped_resident_bytes(path) - before
        if pack_weights:
            # Loaded and packed, the mapping keeps the file's header pages and nothing else (16 KiB
            # here; fault-around may map up to 64 KiB around a read): the norms and biases were
            # copied out and their pages given back (236 pages, 944 KiB, stayed before).
            assert before <= 256 * 1024, before
            assert grown == 0, grown
        else:
            assert grown > 16 * 2**20, grown

    @pytest.mark.parametrize("pack_cache", [False, True])
    def test_resident_memory_stays_at_the_model_file_plus_kv_cache(self, tmp_path, pack_cache):
        """Packing copies the weights but gives the file's pages back: the process grows by no more
        than 10% above the model file plus the KV cache (keeping both copies would be about 2x)."""
        from tests.support.real_models import real_model

        path = tmp_path / "model.mlb"
        shutil.copy(real_model("smollm2-135m").mlb, path)  # its own cache file, beside the copy
        ctx = 512
        before = resident_bytes()
        with Model(path, threads=1, pack=True, pack_cache=pack_cache) as model:
            with model.session(ctx=ctx, batch=32) as session:
                session.eval(list(range(1, 200)))
                grown = resident_bytes() - before
            info = model.info
        kv = 2 * info["n_layers"] * ctx * info["n_kv_heads"] * info["head_dim"] * 4
        assert grown <= 1.10 * (os.path.getsize(path) + kv), (grown, os.path.getsize(path), kv)

    def test_cache_needs_packing(self, tiny_models):
        """pack_cache without pack is a contradiction and is refused."""
        with pytest.raises(ValueError, match="--no-pack"):
            Model(tiny_models["llama", "q4_0"], pack=False, pack_cache=True)


@pytest.fixture
def cached_model(tiny_models, tmp_path):
    """A private copy of a tiny model (its cache goes beside it) and its unpacked logits."""
    path = tmp_path / "model.mlb"
    shutil.copy(tiny_models["qwen2", "q4_0"], path)
    with Model(path, pack=False) as plain:
        want = logits(plain, TOKENS, 4)
    return path, want


def load_cached(path):
    """(status code, note, logits) of a load with the pack cache."""
    with Model(path, threads=1, pack=True, pack_cache=True) as model:
        code, note = pack.status(model)
        return code, note, logits(model, TOKENS, 4)


def rewrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


class PackCacheTests:
    def test_first_load_builds_second_maps(self, cached_model):
        """The first load writes MODEL.mlb.pack; the next one maps it; both give the unpacked bits."""
        path, want = cached_model
        code, note, got = load_cached(path)
        assert code == pack.CACHE_BUILT and "no cache yet" in note
        assert os.path.isfile(pack.cache_path(path))
        assert same_bits(got, want)
        code, note, got = load_cached(path)
        assert code == pack.CACHE_MAPPED, note
        assert same_bits(got, want)

    @pytest.mark.parametrize("damage, reason", [
        ("payload", "corrupt"),
        ("truncate", "wrong size"),
        ("isa", "another ISA"),
        ("layout", "layout version"),
        ("magic", "not a krafla pack cache"),
    ])
    def test_damaged_or_foreign_cache_is_rebuilt(self, cached_model, damage, reason):
        """A cache whose payload, size, ISA, layout version or magic is wrong is rebuilt with the
        reason in the note, and the logits stay those of the unpacked model."""
        path, want = cached_model
        load_cached(path)
        cache = pack.cache_path(path)
        size = os.path.getsize(cache)
        if damage == "payload":
            with open(cache, "r+b") as f:
                f.seek(HEADER_BYTES + (size - HEADER_BYTES) // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))
        elif damage == "truncate":
            os.truncate(cache, size - 100)
        elif damage == "isa":
            rewrite(cache, 16, b"sse9\0")
        elif damage == "layout":
            rewrite(cache, 8, (99).to_bytes(4, "little"))
        else:
            rewrite(cache, 0, b"GARBAGE!")
        code, note, got = load_cached(path)
        assert code == pack.CACHE_BUILT and reason in note, note
        assert same_bits(got, want)
        assert load_cached(path)[0] == pack.CACHE_MAPPED  # the rebuilt cache is good

    def test_cache_of_another_model_is_not_trusted(self, cached_model, tiny_models):
        """Replacing the model file (same name, other weights) makes its old cache stale: rebuilt."""
        path, _ = cached_model
        load_cached(path)
        write_tiny_model(path, "qwen2", seed=8, weight_type="q4_0")  # same shapes, other weights
        with Model(path, pack=False) as plain:
            want = logits(plain, TOKENS, 4)
        code, note, got = load_cached(path)
        assert code == pack.CACHE_BUILT and "another model" in note, note
        assert same_bits(got, want)
        shutil.copy(tiny_models["qwen2", "q8_0"], path)  # another weight type: another payload size too
        code, note, _ = load_cached(path)
        assert code == pack.CACHE_BUILT and "size" in note, note

    def test_unwritable_cache_falls_back_to_memory(self, cached_model):
        """When the cache cannot be written the model still runs packed, and the note says why."""
        path, want = cached_model
        os.mkdir(pack.cache_path(path))  # a directory where the cache file should go
        code, note, got = load_cached(path)
        assert code == pack.CACHE_FAILED and "cannot write the cache" in note and "Is a directory" in note, note
        assert same_bits(got, want)
        with Model(path, threads=1, pack=True, pack_cache=True) as model:
            line = pack.warning(model)
        assert line.startswith("--pack-cache: pack cache not written") and pack.cache_path(path) in line, line

    def test_no_warning_when_the_cache_works(self, cached_model):
        """A cache built or mapped, or packing without a cache, logs nothing."""
        path, _ = cached_model
        for pack_cache in (True, True, False):
            with Model(path, threads=1, pack=True, pack_cache=pack_cache) as model:
                assert pack.status(model)[0] in (pack.CACHE_BUILT, pack.CACHE_MAPPED, pack.PACKED_IN_MEMORY)
                assert pack.warning(model) is None
