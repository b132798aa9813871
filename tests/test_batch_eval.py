"""kr_batch_eval (Model.eval_batch): several sessions in the same forward steps, each getting the
bits it gets alone.

The server's batching of concurrent requests (issue 15) runs one step over every active
sequence: one token of each generating reply plus a chunk of each waiting prompt. The promise
is that a request's logits do not depend on that company: the same request evaluated alone
(Session.eval_all, one model thread) and together with 1, 3 or 7 others (arriving at other
steps, prefilling in other chunks, in any order, on 1 to 4 threads, with sessions of other
contexts and step widths so calls are cut into steps differently) gives the same logits, at
zero tolerance, for every architecture, weight type and KV type. A refused call changes no
session.
"""

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from krafla_twisted.engine import clib
from krafla_twisted.engine.model import ContextFullError, EngineError, InvalidTokenError, Model, kr_batch_item
from tests import strategies
from tests.support.tiny_models import ARCHS, KQUANTS, WEIGHT_TYPES, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35

ALL_ARCHS = ARCHS + ("qwen35",)
# Every architecture and weight type, but k-quants need 256-wide matrices and the tiny qwen35 has none.
CASES = [(arch, weight_type) for arch in ALL_ARCHS for weight_type in WEIGHT_TYPES
         if not (arch == "qwen35" and weight_type in KQUANTS)]
KV_TYPES = ("f32", "f16", "q8_0")
MAX_VOCAB = 60  # below every tiny model's n_vocab


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    """One tiny model per case, head_dim 32 so q8_0 KV caches fit (k-quants: their 256-wide
    shapes, head_dim 64 or 128)."""
    folder = tmp_path_factory.mktemp("batch")
    paths = {}
    for arch, weight_type in CASES:
        path = paths[arch, weight_type] = folder / f"{arch}-{weight_type}.mlb"
        if arch == "qwen35":
            write_tiny_qwen35(path, seed=5, weight_type=weight_type, head_dim=32)
        elif weight_type in KQUANTS:
            write_tiny_model(path, arch, seed=5, weight_type=weight_type)
        else:
            write_tiny_model(path, arch, seed=5, weight_type=weight_type, head_dim=32)
    return paths


def alone(path, tokens, kv):
    """Every position's logits of one sequence evaluated by itself, on one thread."""
    with Model(path, threads=1) as model:
        return model.session(ctx=len(tokens), batch=5, kv=kv).eval_all(tokens)


def run_together(model, plan, kv):
    """Step the plan's sequences together as a scheduler would: at each step, one item per
    sequence that has arrived and is not finished, taking its next step's tokens, in an order
    drawn per step. Returns each sequence's logits as {position: row} and its session."""
    sequences = plan["sequences"]
    rng = np.random.default_rng(plan["order_seed"])
    sessions = [model.session(ctx=len(s["tokens"]) + s["spare_ctx"], batch=s["batch"], kv=kv) for s in sequences]
    got = [{} for _ in sequences]
    done = [0] * len(sequences)    # steps taken
    offset = [0] * len(sequences)  # tokens taken
    step = 0
    while any(d < len(s["steps"]) for d, s in zip(done, sequences)):
        active = [k for k, s in enumerate(sequences) if s["start"] <= step and done[k] < len(s["steps"])]
        rng.shuffle(active)
        items = []
        for k in active:
            s = sequences[k]
            size = s["steps"][done[k]]
            items.append((sessions[k], s["tokens"][offset[k]:offset[k] + size], s["modes"][done[k]]))
        results = model.eval_batch(items) if items else []
        for k, (_, tokens, mode), result in zip(active, items, results):
            if mode == "last":
                got[k][offset[k] + len(tokens) - 1] = result
            elif mode == "all":
                got[k].update({offset[k] + i: row for i, row in enumerate(result)})
            offset[k] += len(tokens)
            done[k] += 1
        step += 1
    return got, sessions


def assert_as_alone(paths_kv, plan, got, sessions):
    """Every logit row a sequence got together equals its row alone, bit for bit."""
    path, kv = paths_kv
    for k, sequence in enumerate(plan["sequences"]):
        assert sessions[k].n_tokens == len(sequence["tokens"])
        if not got[k]:
            continue
        want = alone(path, sequence["tokens"], kv)
        positions = sorted(got[k])
        rows = np.stack([got[k][p] for p in positions])
        differ = np.argwhere(rows.view(np.uint32) != want[positions].view(np.uint32))
        assert not differ.size, (f"sequence {k} (of {len(sessions)}): {len(differ)} logits differ, first "
                                 f"(position, id) {[(positions[i], j) for i, j in differ[:3]]}")


def fixed_plan(n_others, seed):
    """A request with n_others company, drawn from a seed (the explicit counterpart of the
    hypothesis test): arrivals, chunks, modes and session shapes all vary."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(n_others + 1):
        steps = list(rng.integers(1, 10, size=rng.integers(1, 4))) + [1] * int(rng.integers(0, 7))
        sequences.append(dict(tokens=[int(t) for t in rng.integers(0, MAX_VOCAB, size=sum(steps))],
                              steps=[int(n) for n in steps],
                              modes=[str(m) for m in rng.choice(strategies.LOGITS_MODES, size=len(steps))],
                              start=int(rng.integers(0, 9)), spare_ctx=int(rng.integers(0, 9)),
                              batch=int(rng.integers(1, 17))))
    sequences[0]["modes"] = ["all"] * len(sequences[0]["steps"])  # the request: every position checked
    return dict(sequences=sequences, threads=2, order_seed=seed)


class BatchInvarianceTests:
    @pytest.mark.parametrize("kv", KV_TYPES)
    @pytest.mark.parametrize("arch, weight_type", CASES)
    def test_request_with_seven_others(self, tiny_paths, arch, weight_type, kv):
        """Every architecture, weight type and KV type: a request stepped together with 7 others
        on 2 threads gets every position's logits as alone, and so does each of the others."""
        path = tiny_paths[arch, weight_type]
        plan = fixed_plan(7, seed=11)
        with Model(path, threads=plan["threads"]) as model:
            got, sessions = run_together(model, plan, kv)
            assert_as_alone((path, kv), plan, got, sessions)

    @pytest.mark.parametrize("kv", KV_TYPES)
    @pytest.mark.parametrize("arch", ALL_ARCHS)
    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
    @given(weight_type=st.sampled_from(WEIGHT_TYPES), plan=strategies.batch_plans(MAX_VOCAB))
    def test_any_company(self, tiny_paths, arch, kv, weight_type, plan):
        """A request and 1, 3 or 7 random others, arriving at random steps, prefilling in random
        chunks, asking for no, the last or every logit, in a random item order, on 1 to 4
        threads, with sessions of random context and step width: each gets the bits it gets
        alone."""
        assume((arch, weight_type) in tiny_paths)
        path = tiny_paths[arch, weight_type]
        with Model(path, threads=plan["threads"]) as model:
            got, sessions = run_together(model, plan, kv)
            assert_as_alone((path, kv), plan, got, sessions)

    @pytest.mark.parametrize("threads", [1, 2])
    @pytest.mark.parametrize("kv", KV_TYPES)
    def test_positions_that_continue_across_sequences(self, tiny_paths, kv, threads):
        """Items whose positions follow on from each other (one session's tokens at 0..2, the
        next's at 3, 4) are still two sequences: each reads only its own cache (on one thread,
        attention takes a run of consecutive positions as one block)."""
        path = tiny_paths["gemma3", "q8_0"]
        first, second = [3, 9, 27], [50, 1, 7, 30, 2]
        with Model(path, threads=threads) as model:
            a, b = model.session(ctx=8, kv=kv), model.session(ctx=8, kv=kv)
            b.eval(second[:3])
            got = model.eval_batch([(a, first, "all"), (b, second[3:], "all")])
        assert (got[0].view(np.uint32) == alone(path, first, kv).view(np.uint32)).all()
        assert (got[1].view(np.uint32) == alone(path, second, kv)[3:].view(np.uint32)).all()

    def test_one_call_over_several_steps(self, tiny_paths):
        """A call with more tokens than the borrowed scratch's step (sessions of step width 3) is
        cut into consecutive steps, an item straddling two, with the same bits as alone."""
        path = tiny_paths["qwen35", "q4_0"]
        rng = np.random.default_rng(4)
        prompts = [[int(t) for t in rng.integers(0, MAX_VOCAB, size=n)] for n in (7, 1, 5)]
        with Model(path, threads=2) as model:
            sessions = [model.session(ctx=16, batch=3) for _ in prompts]
            got = model.eval_batch([(s, p, "all") for s, p in zip(sessions, prompts)])
        for prompt, rows in zip(prompts, got):
            assert (rows.view(np.uint32) == alone(path, prompt, "f32").view(np.uint32)).all()


class BatchEvalApiTests:
    def test_out_arrays_and_results(self, tiny_paths):
        """eval_batch returns None for "none" and writes into given `out` arrays (returned as
        they are); the last-token logits equal Session.eval's."""
        path = tiny_paths["llama", "f32"]
        with Model(path) as model:
            a, b, c = (model.session(ctx=16) for _ in range(3))
            last = np.empty(model.n_vocab, np.float32)
            rows = np.empty((2, model.n_vocab), np.float32)
            result = model.eval_batch([(a, [1, 2, 3], "none"), (b, [4, 5], "all", rows), (c, [6], "last", last)])
            assert result[0] is None and result[1] is rows and result[2] is last
            assert [s.n_tokens for s in (a, b, c)] == [3, 2, 1]
            alone_session = model.session(ctx=16)
            assert (alone_session.eval([6]).view(np.uint32) == last.view(np.uint32)).all()

    def test_refusals_change_nothing(self, tiny_paths, tmp_path):
        """Each bad call is refused with a message naming the item, and no session moves: the
        sessions then continue exactly as if it had never been made."""
        path = tiny_paths["qwen35", "f32"]
        other_path = tiny_paths["llama", "f32"]
        with Model(path, threads=2) as model, Model(other_path) as other_model:
            a, b = model.session(ctx=8, batch=4), model.session(ctx=8, batch=4)
            model.eval_batch([(a, [1, 2], "none"), (b, [3], "none")])
            foreign = other_model.session(ctx=8)
            closed = model.session(ctx=8)
            closed.close()
            bad_calls = [
                ([(a, [1], "last"), (b, np.array([1, model.n_vocab], np.int32), "last")], InvalidTokenError,
                 rf"item 1: token id {model.n_vocab} at index 1 is outside"),
                ([(a, [1], "last"), (b, [1] * 8, "last")], ContextFullError,
                 "item 1: 8 tokens after 1 do not fit in the context of 8"),
                ([(a, [1], "last"), (a, [2], "last")], InvalidTokenError, "item 1: the session of item 0 is listed again"),
                ([(a, [1], "last"), (foreign, [2], "last")], InvalidTokenError, "item 1: .* is not a session of"),
                ([(a, [1], "last"), (closed, [2], "last")], EngineError, "session is closed"),
                ([(a, [1], "some")], InvalidTokenError, "logits 'some' is not one of none, last, all"),
                ([(a, [], "last")], InvalidTokenError, "non-empty"),
                ([], InvalidTokenError, "at least one"),
            ]
            for items, error, message in bad_calls:
                with pytest.raises(error, match=message):
                    model.eval_batch(items)
                assert (a.n_tokens, b.n_tokens) == (2, 1)
            tail = model.eval_batch([(a, [5, 6], "all"), (b, [7], "last")])
        assert (tail[0].view(np.uint32) == alone(path, [1, 2, 5, 6], "f32")[2:].view(np.uint32)).all()
        assert (tail[1].view(np.uint32) == alone(path, [3, 7], "f32")[1].view(np.uint32)).all()

    def test_c_refusals(self, tiny_paths):
        """The C checks themselves (the binding catches most before): a session of another model,
        a NULL logits_out, a mode out of range, no items; the sessions unchanged."""
        lib = clib.load()
        with Model(tiny_paths["gemma3", "f32"]) as model, Model(tiny_paths["llama", "f32"]) as other_model:
            a, foreign = model.session(ctx=8), other_model.session(ctx=8)
            tokens = (ctypes.c_int32 * 2)(1, 2)
            out = np.empty(model.n_vocab, np.float32)
            cases = [
                ([(foreign.handle, 1, out)], "item 0: the session belongs to another model"),
                ([(a.handle, 1, None)], "item 0: logits_out is NULL"),
                ([(a.handle, 3, out)], "item 0: logits mode 3 is not one of"),
                ([], "kr_batch_eval: no items"),
            ]
            for rows, message in cases:
                items = (kr_batch_item * max(len(rows), 1))()
                for item, (session, mode, target) in zip(items, rows):
                    item.session, item.tokens, item.n_tokens, item.logits = session, tokens, 2, mode
                    item.logits_out = target.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if target is not None \
                        else None
                error = clib.kr_error()
                assert lib.kr_batch_eval(model.handle, items, len(rows), ctypes.byref(error)) != 0
                assert message in error.message.decode()
                assert (a.n_tokens, foreign.n_tokens) == (0, 0)
