"""One forward step over tokens of several sequences gives each token the bits it gets alone.

The engine's step takes a batch whose tokens may belong to different sequences at different
positions (engine_c/src/model/model.h, kr_batch; docs/architecture.md): the server's batching of
concurrent requests builds on it. kr_test_eval_mixed runs such steps over sessions of one model;
every token's logits must equal, bit for bit, those the same sequence gives evaluated alone, one
token at a time, for every architecture (qwen35's recurrent state included), weight and KV type.
"""

import ctypes

import numpy as np
import pytest

from krafla_twisted.engine import clib
from krafla_twisted.engine.model import Model
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35


def eval_mixed(sessions, tokens, which):
    """Logits (n, n_vocab) of one step: tokens[i] appended to sessions[which[i]]."""
    lib = sessions[0].model._lib
    clib.declare(lib, "kr_test_eval_mixed", ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(clib.kr_error))
    handles = (ctypes.c_void_p * len(sessions))(*[s._check_open() for s in sessions])
    tokens, which = np.ascontiguousarray(tokens, np.int32), np.ascontiguousarray(which, np.int32)
    logits = np.empty((tokens.size, sessions[0].model.n_vocab), np.float32)
    error = clib.kr_error()
    lib.kr_test_eval_mixed(handles, len(sessions), tokens.ctypes.data, which.ctypes.data, tokens.size,
                           logits.ctypes.data, ctypes.byref(error))
    error.check()
    return logits


def alone(model, ids, kv):
    """Every position's logits of one sequence, evaluated token after token in its own session."""
    session = model.session(ctx=64, batch=1, kv=kv)
    return np.stack([session.eval(np.asarray([t], np.int32)) for t in ids])


def write(path, arch, weight_type):
    if arch == "qwen35":
        return write_tiny_qwen35(path, seed=3, weight_type=weight_type, head_dim=32)
    write_tiny_model(path, arch, seed=3, weight_type=weight_type, head_dim=32)
    return path


class MixedBatchTests:
    @pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
    @pytest.mark.parametrize("weight_type", ["f32", "q4_0"])
    @pytest.mark.parametrize("arch", ARCHS + ("qwen35",))
    def test_each_token_as_alone(self, tmp_path, arch, weight_type, kv):
        """Three sequences of different lengths, their tokens interleaved at random into steps of
        1 to 9 tokens (a sequence's tokens side by side or apart, at different positions), on 2
        threads: every token's logits equal the ones its sequence gives alone."""
        path = write(tmp_path / "m.mlb", arch, weight_type)
        rng = np.random.default_rng(8)
        sequences = [list(rng.integers(0, 60, size=size)) for size in (17, 5, 26)]
        with Model(path, threads=2) as model:
            want = [alone(model, ids, kv) for ids in sequences]
            sessions = [model.session(ctx=64, batch=16, kv=kv) for _ in sequences]
            order = np.concatenate([[k] * len(ids) for k, ids in enumerate(sequences)])
            rng.shuffle(order)
            got = [[] for _ in sequences]
            start = 0
            while start < order.size:
                which = order[start:start + int(rng.integers(1, 10))]
                tokens = [sequences[k][len(got[k]) + int(np.sum(which[:i] == k))] for i, k in enumerate(which)]
                for row, k in zip(eval_mixed(sessions, tokens, which), which):
                    got[k].append(row)
                start += which.size
            for k in range(len(sequences)):
                differ = np.argwhere(np.stack(got[k]).view(np.uint32) != want[k].view(np.uint32))
                assert not differ.size, f"sequence {k}: {len(differ)} logits differ, first (position, id) {differ[:3]}"
                assert sessions[k].n_tokens == len(sequences[k])

    def test_refusals(self, tmp_path):
        """A step larger than the scratch, a token naming no session, or a full context is refused
        before any work, the sessions unchanged."""
        path = write(tmp_path / "m.mlb", "llama", "f32")
        with Model(path) as model:
            sessions = [model.session(ctx=8, batch=4), model.session(ctx=8, batch=4)]
            with pytest.raises(clib.KraflaError, match="5 tokens do not fit in a step of 4"):
                eval_mixed(sessions, [1] * 5, [0] * 5)
            with pytest.raises(clib.KraflaError, match="names session 2"):
                eval_mixed(sessions, [1, 2], [0, 2])
            eval_mixed(sessions[1:], [1, 2, 3, 4], [0] * 4)
            eval_mixed(sessions[1:], [1, 2, 3, 4], [0] * 4)
            with pytest.raises(clib.KraflaError, match="context of 8 is full"):
                eval_mixed(sessions, [1, 2], [0, 1])
            assert [s.n_tokens for s in sessions] == [0, 8]
