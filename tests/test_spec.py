"""Speculative decoding (krafla_twisted/generation/speculate.py) changes no bit of a reply.

The reference is the same generation without speculation: its tokens, every logit the sampler saw
(recorded through a pass-through constraint) and its logprobs. With prompt lookup and with a draft
model, alone and in a four-slot scheduler, on every tiny architecture and KV type, greedy and seeded
replies must equal it exactly. The sampled distribution is checked against the model's own
probabilities (a softmax of logits the engine gives token by token, in numpy) under a proposer that
proposes on every step, so the rejection rule is exercised on every token. Grammar, stop strings and
logprobs are checked on SmolLM2 with its tokenizer; the command line refuses a draft whose tokenizer
is not the model's.
"""

import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from krafla_twisted.chat import templates
from krafla_twisted.engine.model import Model
from krafla_twisted.generation import grammar
from krafla_twisted.generation.generate import Generation, Generator, Runtime, SamplingParams, run_alone
from krafla_twisted.generation.scheduler import Scheduler
from krafla_twisted.generation.speculate import (DraftError, DraftLength, DraftModel, LookupProposer, Speculation,
                                                 check_same_vocabulary)
from tests.support.letters import LetterTokenizer, RecordingConstraint
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35

KV_TYPES = ("f32", "f16", "q8_0")


def tiny(path, arch, seed=3):
    if arch == "qwen35":
        return write_tiny_qwen35(path, seed=seed, head_dim=32)
    write_tiny_model(path, arch, seed=seed, head_dim=32)
    return path


def runtime_of(path, kv="f32", parallel=1, speculation=None, batch=16):
    model = Model(path, threads=2)
    return Runtime(model, LetterTokenizer(model.n_vocab), ctx=128, kv=kv, batch=batch, parallel=parallel,
                   speculation=speculation)


# Prompts that repeat themselves, so that lookup finds matches, and one that does not.
def prompts(n_vocab):
    rng = np.random.default_rng(5)
    motif = [int(t) for t in rng.integers(0, n_vocab, size=6)]
    return [motif * 4, [int(t) for t in rng.integers(0, n_vocab, size=23)], motif[:3] * 7 + [1, 2]]


SAMPLINGS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.95, seed=11),
             SamplingParams(temperature=1.3, top_k=9, repeat_penalty=1.1, seed=2**63 + 5))


def run(runtime, prompt, sampling, max_tokens=40, parallel_with=()):
    """(result, recorded logits): alone, or beside the `parallel_with` generations in a Scheduler."""
    constraint = RecordingConstraint()
    generation = Generation(runtime, prompt, max_tokens=max_tokens, sampling=sampling, constraint=constraint,
                            logprobs=3)
    if not parallel_with:
        return run_alone(generation), constraint.logits
    scheduler = Scheduler(runtime)
    for other in parallel_with:
        scheduler.add(Generation(runtime, other, max_tokens=max_tokens, sampling=sampling))
    scheduler.add(generation)
    while scheduler.busy:
        scheduler.step()
    return generation.result, constraint.logits


def assert_same(want, got):
    (result, logits), (spec_result, spec_logits) = want, got
    assert spec_result.tokens == result.tokens
    assert spec_result.text == result.text and spec_result.finish_reason == result.finish_reason
    assert spec_result.logprobs == result.logprobs
    assert len(spec_logits) == len(logits)
    for step, (a, b) in enumerate(zip(logits, spec_logits)):
        differ = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
        assert not differ.size, f"step {step}: {differ.size} logits differ"


class LookupEqualityTests:
    @pytest.mark.parametrize("kv", KV_TYPES)
    @pytest.mark.parametrize("arch", ARCHS + ("qwen35",))
    def test_alone_and_beside_others(self, tmp_path, arch, kv):
        """Three prompts, one greedy, one seeded with top-p, one seeded with top-k and a repeat penalty:
        with --spec lookup the reply, every logit and the logprobs equal those without, run alone and
        as one of four in a --parallel 4 scheduler (the other three sampled the same way). Speculation proposes and is accepted (Qwen3.5, whose
        cache cannot be cut back, does not speculate)."""
        path = tiny(tmp_path / "m.mlb", arch)
        plain = runtime_of(path, kv, parallel=4)
        spec = runtime_of(path, kv, parallel=4, speculation=Speculation("lookup"))
        try:
            asks = prompts(plain.model.n_vocab)
            proposed = accepted = 0
            for index, (prompt, sampling) in enumerate(zip(asks, SAMPLINGS)):
                plain.reset(), spec.reset()
                assert_same(run(plain, prompt, sampling), run(spec, prompt, sampling))
                others = asks[:index] + asks[index + 1:] + [prompt[::-1]]
                plain.reset(), spec.reset()
                want = run(plain, prompt, sampling, parallel_with=others)
                got = run(spec, prompt, sampling, parallel_with=others)
                assert_same(want, got)
                proposed += got[0].proposed_tokens
                accepted += got[0].accepted_tokens
            if arch == "qwen35":
                assert proposed == 0
            else:
                assert accepted > 0 and proposed >= accepted
        finally:
            plain.close(), spec.close()

    def test_a_warm_cache_after_speculation(self, tmp_path):
        """After a reply with speculation the slot's cache holds exactly prompt and reply (the rejected
        tokens cut away): the next turn, reusing it, gets the reply a cold cache gets."""
        path = tiny(tmp_path / "m.mlb", "llama")
        with runtime_of(path, speculation=Speculation("lookup")) as spec, runtime_of(path) as plain:
            prompt = prompts(spec.model.n_vocab)[0]
            first = Generator(spec).generate(prompt, max_tokens=30, sampling=SamplingParams())
            assert first.proposed_tokens > first.accepted_tokens > 0
            assert spec.cached == prompt + list(first.tokens[:-1])
            assert spec.session.n_tokens == len(spec.cached)
            follow = prompt + list(first.tokens) + prompt[:5]
            warm = Generator(spec).generate(follow, max_tokens=20, sampling=SamplingParams())
            assert warm.cached_tokens > len(prompt)
            cold = Generator(plain).generate(follow, max_tokens=20, sampling=SamplingParams())
            assert warm.tokens == cold.tokens

    def test_max_tokens_is_kept(self, tmp_path):
        """A proposal never runs past max_tokens: every limit from 1 to 12 gives the reply's prefix."""
        path = tiny(tmp_path / "m.mlb", "qwen2")
        with runtime_of(path, speculation=Speculation("lookup")) as spec:
            prompt = prompts(spec.model.n_vocab)[0]
            full = Generator(spec).generate(prompt, max_tokens=12, sampling=SamplingParams())
            for limit in range(1, 13):
                spec.reset()
                got = Generator(spec).generate(prompt, max_tokens=limit, sampling=SamplingParams())
                assert got.tokens == full.tokens[:limit] and got.completion_tokens == limit


class LookupProposerTests:
    def test_the_longest_most_recent_match(self):
        """The continuation of the most recent earlier occurrence of the longest suffix (of 3 or 2 tokens)
        that occurred."""
        proposer = LookupProposer([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
        proposer.length.length = 3
        assert proposer.propose([], 5) == [7, 8, 5]       # "2 3" last seen before 7 8 5 (the 3-gram 5 2 3 is new)
        assert proposer.propose([4], 5) == []              # 4 never occurred
        proposer.length.length = 8
        assert proposer.propose([4, 1, 2], 2) == [3, 7]    # "4 1 2" is new, "1 2" last seen before 3 7
        assert proposer.propose([4, 1, 2, 3, 9, 1], 9) == [2, 3, 7, 8, 5, 2, 3, 4]
        assert proposer.propose([4, 1, 2, 3, 9, 1, 6, 8], 9) == []  # only "8" occurred: one token is no match


    def test_the_length_adapts(self):
        """Whole proposals taken: twice as many next (up to the most); a partial one: one more than was
        accepted; two misses in a row: a pause of one step, then of two after the next two misses."""
        length = DraftLength(start=4, most=16)
        length.observe(4, 4)
        assert length.wanted() == 8
        length.observe(8, 8), length.observe(16, 16)
        assert length.wanted() == 16
        length.observe(16, 5)
        assert length.wanted() == 6
        length.observe(6, 0), length.observe(1, 0)
        assert [length.wanted() for _ in range(2)] == [0, 1]
        length.observe(1, 0), length.observe(1, 0)
        assert [length.wanted() for _ in range(3)] == [0, 0, 1]


class FixedProposer:
    """Proposes `tokens` on every step (as many as allowed), whatever the sequence."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, reply, most):
        return list(self.tokens[:most])

    def observe(self, proposed, accepted):
        pass


class FixedSpeculation(Speculation):
    def __init__(self, tokens):
        super().__init__("lookup")
        self.tokens = tokens

    def proposer(self, runtime, slot, prompt):
        return FixedProposer(self.tokens)


def softmax(logits, temperature):
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def chi_square_limit(degrees, z=4.0):
    """The chi-square quantile at the normal deviate z (Wilson-Hilferty): p about 3e-5 for z = 4."""
    k = degrees
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


class DistributionTests:
    def test_sampled_tokens_follow_the_model(self, tmp_path):
        """3000 seeds, temperature 0.6 over a 67-token vocabulary, three reply tokens, with a proposer
        that proposes the same token on every step, the one likeliest second (so it is often accepted
        and often not). The first token is sampled from the prompt's logits; the second from a
        verified row, whether the proposal was taken or not: the pairs' counts fit the model's joint
        probabilities p(t1) p(t2 | t1), from numpy's softmax of logits the engine gives without
        speculation, token by token (chi-square over the bins expected to hold at least 5, the rest
        pooled). The third token, after an accepted proposal, comes from the row after it: its counts
        after the commonest such pair fit p(t3 | t1, t2). And each seed gives the reply it gives
        without speculation."""
        path = tiny(tmp_path / "m.mlb", "llama", seed=21)
        prompt = [5, 17, 3, 40, 22]
        temperature, draws = 0.6, 3000
        with runtime_of(path) as plain:
            def probabilities(tokens):
                plain.reset()
                return softmax(np.array(plain.session.eval(tokens)), temperature)

            first = probabilities(prompt)
            second = np.stack([probabilities(prompt + [t]) for t in range(len(first))])
            joint = first[:, None] * second
            proposed = int(joint.sum(axis=0).argmax())
            with runtime_of(path, speculation=FixedSpeculation([proposed])) as spec:
                replies = []
                for seed in range(draws):
                    sampling = SamplingParams(temperature=temperature, top_p=1.0, seed=seed)
                    spec.reset()
                    got = Generator(spec).generate(prompt, max_tokens=3, sampling=sampling)
                    replies.append(got.tokens)
                    assert got.proposed_tokens == 1 and got.accepted_tokens == int(got.tokens[1] == proposed)
                    if seed % 150 == 0:
                        plain.reset()
                        assert Generator(plain).generate(prompt, max_tokens=3, sampling=sampling).tokens == got.tokens
            pairs = np.array([r[0] * len(first) + r[1] for r in replies])
            self.assert_fits(pairs, joint.ravel())
            taken = [r for r in replies if r[1] == proposed]
            assert 0.1 * draws < len(taken) < 0.9 * draws
            common = int(np.bincount([r[0] for r in taken]).argmax())
            thirds = np.array([r[2] for r in taken if r[0] == common])
            assert len(thirds) > 100
            self.assert_fits(thirds, probabilities(prompt + [common, proposed]))

    @staticmethod
    def assert_fits(draws, probabilities):
        counts = np.bincount(draws, minlength=len(probabilities)).astype(np.float64)
        expected = probabilities * len(draws)
        big = expected >= 5
        observed = np.append(counts[big], counts[~big].sum())
        wanted = np.append(expected[big], expected[~big].sum())
        if wanted[-1] < 5:  # pool a small remainder into the smallest bin
            observed, wanted = observed[:-1], wanted[:-1]
            smallest = np.argmin(wanted)
            observed[smallest] += counts[~big].sum()
            wanted[smallest] += expected[~big].sum()
        statistic = float(np.sum((observed - wanted) ** 2 / wanted))
        assert statistic < chi_square_limit(len(wanted) - 1), (statistic, len(wanted))


class DraftTests:
    @pytest.mark.parametrize("kv", KV_TYPES)
    @pytest.mark.parametrize("arch", ARCHS)
    def test_draft_replies_equal(self, tmp_path, arch, kv):
        """A draft model (the same weights: every proposal right; other weights: most proposals wrong)
        gives the replies, logits and logprobs of no speculation, greedy and seeded, alone and at
        --parallel 4."""
        path = tiny(tmp_path / "m.mlb", arch)
        other = tiny(tmp_path / "d.mlb", arch, seed=8)
        plain = runtime_of(path, kv, parallel=4)
        try:
            for draft_path in (path, other):
                draft = DraftModel(Model(draft_path, threads=2), 4, ctx=128, kv=kv, batch=16)
                spec = runtime_of(path, kv, parallel=4, speculation=Speculation("draft", draft))
                try:
                    asks = prompts(plain.model.n_vocab)
                    accepted = 0
                    for sampling in SAMPLINGS[:2]:
                        plain.reset(), spec.reset()
                        got = run(spec, asks[1], sampling)
                        assert_same(run(plain, asks[1], sampling), got)
                        accepted += got[0].accepted_tokens
                        plain.reset(), spec.reset()
                        got = run(spec, asks[0], sampling, parallel_with=asks[1:])
                        assert_same(run(plain, asks[0], sampling, parallel_with=asks[1:]), got)
                        accepted += got[0].accepted_tokens
                    if draft_path == path:
                        assert accepted >= 40
                finally:
                    spec.close()
        finally:
            plain.close()


class PieceTokenizer:
    """A tokenizer's table of pieces, for the vocabulary check."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.n_vocab = len(pieces)

    def token_bytes(self, token):
        return self.pieces[token]

    def token_type(self, token):
        return 1


class VocabularyCheckTests:
    def test_one_different_token_is_named(self):
        """A draft whose tokenizer differs from the model's in one piece is refused, naming that token
        and both pieces; the same table passes."""
        mine = PieceTokenizer([b"a", b"b", b" the", b"c"])
        check_same_vocabulary(mine, PieceTokenizer(list(mine.pieces)), 4, 4, "d.mlb")
        with pytest.raises(DraftError, match=r"--draft d.mlb: token 2 is b' tha' in the draft's tokenizer but "
                                             r"b' the' in the model's"):
            check_same_vocabulary(mine, PieceTokenizer([b"a", b"b", b" tha", b"c"]), 4, 4, "d.mlb")
        with pytest.raises(DraftError, match="the draft model has 5 tokens but the model 4"):
            check_same_vocabulary(mine, PieceTokenizer([b"a", b"b", b" the", b"c", b"d"]), 4, 5, "d.mlb")


# ---------------------------------------------------------------------------------------------
# SmolLM2: grammar, stop strings, logprobs; the command line


@pytest.fixture(scope="module")
def smollm():
    from tests.support.real_models import real_model

    return real_model("smollm2-135m")


def smollm_runtime(pulled, speculation):
    from krafla_twisted.engine.tokenizer import Tokenizer

    return Runtime(Model(str(pulled.mlb), threads=2), Tokenizer(str(pulled.mlt)), templates.get_template("smollm"),
                   ctx=1024, batch=64, speculation=speculation)


CODE = '''def total_area(shapes):
    total = 0
    for shape in shapes:
        total += shape.width * shape.height
    return total
'''


class RealModelTests:
    def test_grammar_stop_and_logprobs(self, smollm):
        """With a JSON-schema grammar, a stop string and logprobs, each reply equals the one without
        speculation (text, tokens, logprobs with their alternatives, where it stopped), and
        speculation both proposed and had proposals accepted."""
        from krafla_twisted.generation.generate import build_prompt

        plain = smollm_runtime(smollm, None)
        spec = smollm_runtime(smollm, Speculation("lookup"))
        try:
            vocabulary = grammar.Vocabulary.of(plain.tokenizer, plain.stop_token_ids)
            schema = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
            ask = [{"role": "user", "content": "Rewrite this function so that it is called area_sum, and give the "
                                               "whole function:\n" + CODE}]
            cases = [dict(constraint=lambda: grammar.Constraint(vocabulary, grammar.json_schema_grammar(schema)),
                          stop=(), max_tokens=60),
                     dict(constraint=lambda: None, stop=("return",), max_tokens=80),
                     dict(constraint=lambda: None, stop=(), max_tokens=50)]
            proposed = accepted = 0
            for case in cases:
                results = []
                for runtime in (plain, spec):
                    prompt = build_prompt(runtime, messages=ask, stop=case["stop"])
                    runtime.reset()
                    results.append(Generator(runtime).generate(
                        prompt.tokens, max_tokens=case["max_tokens"], sampling=SamplingParams(),
                        stop_strings=prompt.stop_strings, constraint=case["constraint"](), logprobs=2))
                want, got = results
                assert (got.text, got.tokens, got.logprobs, got.finish_reason, got.stop_string) == \
                    (want.text, want.tokens, want.logprobs, want.finish_reason, want.stop_string)
                proposed += got.proposed_tokens
                accepted += got.accepted_tokens
            assert accepted > 20 and proposed > accepted
        finally:
            plain.close(), spec.close()

    def test_run_with_a_draft(self, smollm, tmp_path):
        """`krafla run --draft` with the model itself as the draft prints what --spec none prints; a
        draft whose vocabulary is not the model's is refused at start with the reason."""
        base = [sys.executable, "-m", "krafla_twisted.cli.main", "run", str(smollm.mlb), "-z", str(smollm.mlt),
                "--chat", "smollm", "-t", "2", "-n", "60", "-p", "Copy this function exactly:\n" + CODE]
        plain = subprocess.run(base + ["--spec", "none"], capture_output=True, text=True, timeout=120)
        drafted = subprocess.run(base + ["--draft", str(smollm.mlb)], capture_output=True, text=True, timeout=120)
        assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
        assert drafted.stdout == plain.stdout
        assert "speculation" in drafted.stderr and "speculation" not in plain.stderr
        tiny_draft = tiny(tmp_path / "draft.mlb", "llama")
        shutil.copy(smollm.mlt, tmp_path / "draft.mlt")
        refused = subprocess.run(base + ["--draft", str(tiny_draft)], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1
        assert "the draft model has 67 tokens but the model 49152" in refused.stderr


class ServerTests:
    def test_metrics_and_log_line(self, smollm):
        """A `twistd krafla --metrics` (speculation on by default) answers a code-editing chat with the
        text the same prompt gets without speculation; /metrics counts the proposed and accepted tokens
        and the request's log line reports the same numbers; streamed logprobs equal the whole reply's
        although several tokens come out of one step."""
        import httpx2
        from prometheus_client.parser import text_string_to_metric_families

        from krafla_twisted.generation.generate import build_prompt
        from tests.support.server import ServerProcess

        ask = [{"role": "user", "content": "Rewrite this function so that it is called area_sum, and give the "
                                           "whole function:\n" + CODE}]
        with smollm_runtime(smollm, None) as plain:
            prompt = build_prompt(plain, messages=ask)
            want = Generator(plain).generate(prompt.tokens, max_tokens=60, sampling=SamplingParams(),
                                             stop_strings=prompt.stop_strings)
        server = ServerProcess([str(smollm.mlb), "-z", str(smollm.mlt), "--chat", "smollm", "-t", "2", "--metrics",
                                "--parallel", "2"]).start()
        try:
            reply = httpx2.post(server.url("/chat/completions"), json={"messages": ask, "max_tokens": 60},
                                timeout=300).json()
            assert reply["choices"][0]["message"]["content"] == want.text
            text = httpx2.get(server.root_url("/metrics"), timeout=60).text
            samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples}
            proposed = samples["krafla_speculative_proposed_tokens_total"]
            accepted = samples["krafla_speculative_accepted_tokens_total"]
            assert proposed >= accepted > 10
            line = server.wait_for(lambda entry: "POST /v1/chat/completions 200" in entry)
            assert f"speculation {int(accepted)}/{int(proposed)} proposed tokens accepted" in line
            # Several tokens per step: streamed, each token's logprobs still arrive once, in order.
            from openai import OpenAI

            client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
            ask_logprobs = dict(model="local", messages=ask, max_tokens=60, logprobs=True, top_logprobs=2)
            whole = client.chat.completions.create(**ask_logprobs).choices[0].logprobs.content
            streamed = [entry for chunk in client.chat.completions.create(stream=True, **ask_logprobs)
                        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
            assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
            assert "".join(e.token for e in whole) == want.text
        finally:
            server.stop()
