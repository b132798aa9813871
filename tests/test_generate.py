"""The generation loop (krafla_twisted/generation/generate.py).

Unit tests drive it with a scripted fake model (its logits pick the next token of a script, or
come from a hash of the history) so each rule is checked in isolation: stop tokens and stop
strings across token boundaries, held-back text, UTF-8 split across tokens, max_tokens, a full
context, cancellation and KV prefix reuse. Then the real SmolLM2 model: a warm cache gives
bitwise the reply a cold one gives.
"""

import codecs
import hashlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from krafla_twisted.chat import templates
from krafla_twisted.generation.generate import (ContextLengthExceeded, Generator, Runtime, SamplingParams,
                                               StopStringFilter)

EOS = 0

# ------------------------------------------------------------------------------------------
# Fakes


class FakeTokenizer:
    """Token i decodes to VOCAB[i]; 0 is EOS, 1 BOS."""

    def __init__(self, vocab):
        self.vocab = list(vocab)
        self.n_vocab = len(self.vocab)
        self.bos_id, self.eos_id, self.add_bos = 1, EOS, False
        self.eot_ids = frozenset({EOS})

    def token_id(self, text):
        data = text.encode()
        return self.vocab.index(data) if data in self.vocab[:2] else None

    def encode(self, text, add_bos=None, special=False):
        return [self.vocab.index(bytes([b])) for b in text.encode()]

    def streaming_decoder(self, special=False):
        return _Decoder(self)  # (no control tokens: `special` changes nothing)


class _Decoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token):
        return self.utf8.decode(self.tokenizer.vocab[token])

    def flush(self):
        return self.utf8.decode(b"", final=True)


class FakeSession:
    """A KV cache of token ids. After a history that starts with a scripted prompt, the logits
    put 10.0 on the script's next token (EOS after the script); otherwise (or with `noisy`) they
    are a hash of the whole history, so they depend on every token, like a real model's."""

    def __init__(self, n_vocab, n_ctx, scripts, noisy=False):
        self.n_vocab, self.n_ctx, self.scripts, self.noisy = n_vocab, n_ctx, scripts, noisy
        self.tokens = []
        self.evals = []       # each eval call's tokens
        self.truncations = []

    @property
    def n_tokens(self):
        return len(self.tokens)

    def eval(self, tokens, out=None):
        """As Session.eval: the logits, written into `out` (a float32 buffer) when one is given."""
        tokens = [int(t) for t in tokens]
        assert tokens and len(self.tokens) + len(tokens) <= self.n_ctx
        self.evals.append(tokens)
        self.tokens.extend(tokens)
        if out is None:
            return self.logits()
        memoryview(out)[:] = memoryview(self.logits())
        return out

    def truncate(self, n):
        assert 0 <= n <= len(self.tokens)
        self.truncations.append(n)
        del self.tokens[n:]

    def logits(self):
        digest = hashlib.sha256(np.array(self.tokens, dtype=np.int64).tobytes()).digest()
        logits = np.random.default_rng(int.from_bytes(digest[:8], "little")).normal(0, 1, self.n_vocab)
        logits = logits.astype(np.float32)
        if not self.noisy:
            for prompt, reply in sorted(self.scripts.items(), key=lambda item: -len(item[0])):
                if tuple(self.tokens[:len(prompt)]) == prompt:
                    index = len(self.tokens) - len(prompt)
                    logits[reply[index] if index < len(reply) else EOS] = 10.0
                    break
        return logits

    def close(self):
        pass


class FakeModel:
    def __init__(self, n_vocab, n_ctx=64, scripts=None, noisy=False):
        self.n_vocab, self.n_ctx, self.scripts, self.noisy = n_vocab, n_ctx, scripts or {}, noisy
        self.threads = 1

    def session(self, ctx=None, kv="f32", batch=32):
        self.last_session = FakeSession(self.n_vocab, ctx or self.n_ctx, self.scripts, self.noisy)
        return self.last_session

    def close(self):
        pass


# Byte-per-token vocabulary: id 0 EOS, 1 BOS, then every byte value at 2 + b; then a few
# multi-character tokens so stop strings can span tokens of different lengths.
MULTI = [b"He", b"llo", b" wor", b"ld", b"ST", b"OP", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xff", b"<|", b"end|>"]
VOCAB = [b"</s>", b"<s>"] + [bytes([b]) for b in range(256)] + MULTI


def tid(piece):
    return VOCAB.index(piece)


def ids(*pieces):
    return [tid(p) for p in pieces]


PROMPT = tuple(ids(b"Q", b":"))


def make_runtime(reply_pieces=(), *, n_ctx=64, batch=32, noisy=False, scripts=None, template=None, eos=None):
    scripts = scripts if scripts is not None else {PROMPT: ids(*reply_pieces)}
    model = FakeModel(len(VOCAB), n_ctx, scripts, noisy)
    return Runtime(model, FakeTokenizer(VOCAB), template, ctx=n_ctx, batch=batch, eos=eos)


def run(runtime, prompt=PROMPT, **kwargs):
    pieces = []
    kwargs.setdefault("sampling", SamplingParams())
    result = Generator(runtime).generate(list(prompt), on_text=pieces.append, **kwargs)
    assert "".join(pieces) == result.text  # on_text saw exactly the reply, nothing held back leaked
    return result, pieces


# ------------------------------------------------------------------------------------------
# Unit tests


class ReplyTests:
    def test_reply_until_eos(self):
        """The scripted tokens come out as text; EOS ends with "stop" and is not counted."""
        result, _ = run(make_runtime([b"He", b"llo", b" wor", b"ld"]))
        assert result.text == "Hello world"
        assert (result.finish_reason, result.completion_tokens, result.prompt_tokens) == ("stop", 4, 2)
        assert list(result.tokens) == ids(b"He", b"llo", b" wor", b"ld")

    def test_max_tokens(self):
        """max_tokens ends the reply with "length" after exactly that many tokens."""
        result, _ = run(make_runtime([b"He", b"llo", b" wor", b"ld"]), max_tokens=2)
        assert (result.text, result.finish_reason, result.completion_tokens) == ("Hello", "length", 2)

    def test_context_full(self):
        """A reply that fills the context ends with "length": prompt + reply == n_ctx."""
        runtime = make_runtime([b"a"] * 50, n_ctx=8)
        result, _ = run(runtime)
        assert (result.finish_reason, result.completion_tokens) == ("length", 6)
        assert runtime.session.n_tokens <= 8

    def test_prompt_too_long_is_refused_before_any_work(self):
        """A prompt of n_ctx tokens (no room for a reply) raises ContextLengthExceeded and
        evaluates nothing."""
        runtime = make_runtime([b"a"], n_ctx=4)
        with pytest.raises(ContextLengthExceeded, match="4 tokens") as caught:
            Generator(runtime).generate(ids(b"a", b"b", b"c", b"d"), sampling=SamplingParams())
        assert isinstance(caught.value, ValueError)
        assert runtime.session.evals == []
        result, _ = run(runtime, prompt=ids(b"a", b"b", b"c"))  # one token of room: one reply token
        assert (result.completion_tokens, result.finish_reason) == (1, "length")

    def test_bad_prompts(self):
        """Empty prompts, ids outside the vocabulary and negative max_tokens are ValueErrors."""
        runtime = make_runtime([b"a"])
        for prompt, kwargs in (([], {}), ([len(VOCAB)], {}), ([-1], {}), (list(PROMPT), {"max_tokens": -1})):
            with pytest.raises(ValueError):
                Generator(runtime).generate(prompt, sampling=SamplingParams(), **kwargs)

    def test_bad_sampling(self):
        """Sampling parameters are checked, naming the field."""
        runtime = make_runtime([b"a"])
        with pytest.raises(ValueError, match="temperature"):
            run(runtime, sampling=SamplingParams(temperature=float("nan")))
        with pytest.raises(ValueError, match="top_p"):
            run(runtime, sampling=SamplingParams(top_p=2))

    def test_cancelled_between_tokens(self):
        """cancelled() is asked before each token (and once per prompt batch): after it turns
        true the reply stops with "cancelled" and keeps the text made so far."""
        answers = iter([False, False, False, True])
        result, _ = run(make_runtime([b"He", b"llo", b" wor", b"ld"]), cancelled=lambda: next(answers))
        assert (result.text, result.finish_reason, result.completion_tokens) == ("Hello", "cancelled", 2)

    def test_cancelled_during_the_prompt(self):
        """A long prompt is evaluated in batches and cancellation is checked between them."""
        runtime = make_runtime([b"a"], batch=2, scripts={})
        calls = []
        result = Generator(runtime).generate(ids(*[b"x"] * 9), sampling=SamplingParams(),
                                             cancelled=lambda: len(calls) >= 2,
                                             on_prompt_progress=lambda done, total: calls.append((done, total)))
        assert result.finish_reason == "cancelled" and result.completion_tokens == 0
        assert calls == [(2, 9), (4, 9)]
        assert runtime.session.evals == [ids(b"x", b"x")] * 2

    def test_runtime_refuses_mismatched_files(self):
        """A tokenizer of another vocabulary size, or an end token outside the vocabulary, is refused."""
        with pytest.raises(ValueError, match="do not belong together"):
            Runtime(FakeModel(len(VOCAB) + 1), FakeTokenizer(VOCAB))
        with pytest.raises(ValueError, match="token 9999 is not a token id"):
            Runtime(FakeModel(len(VOCAB)), FakeTokenizer(VOCAB), eos=9999)

    def test_template_stop_token_and_eos_override(self):
        """The template's stop token ends a reply; --eos replaces the tokenizer's EOS."""
        runtime = make_runtime([b"a", b"<s>", b"b"])
        assert run(runtime)[0].text == "a<s>b"

        class OneStop(templates.ChatMLTemplate):
            stop_markers = ("<s>",)

        assert run(make_runtime([b"a", b"<s>", b"b"], template=OneStop("x", None, ("<s>",))))[0].text == "a"
        result, _ = run(make_runtime([b"a", b"b", b"c"], eos=tid(b"b")))
        assert (result.text, result.finish_reason) == ("a", "stop")


class StopStringTests:
    def test_stop_string_across_tokens(self):
        """A stop string spread over tokens ends the reply before it; its start never reached
        on_text."""
        result, pieces = run(make_runtime([b"He", b"llo", b" wor", b"ld"]), stop_strings=["lo wo"])
        assert (result.text, result.finish_reason) == ("Hel", "stop")
        assert pieces == ["He", "l"]

    def test_held_back_text_is_released(self):
        """Text that only looked like the start of a stop string comes out once it cannot be one."""
        result, pieces = run(make_runtime([b"S", b"T", b"x", b"S"]), stop_strings=["STOP"])
        assert (result.text, result.finish_reason) == ("STxS", "stop")
        assert pieces == ["STx", "S"]  # the final "S" is released at the end (EOS)

    def test_earliest_of_several_stop_strings(self):
        """With several stop strings the reply ends at the one that starts first."""
        result, _ = run(make_runtime([b"He", b"llo", b" wor", b"ld"]), stop_strings=["world", "llo w", "o"])
        assert result.text == "He"  # "llo w" starts before "o", though "o" completes first
        assert result.stop_string == "llo w"
        result, _ = run(make_runtime([b"He", b"llo"]))
        assert result.stop_string is None   # ended by the end-of-reply token

    def test_stop_string_in_the_held_back_end(self):
        """A reply cut by max_tokens while a complete stop string waits behind a longer possible
        one still ends before the stop string."""
        result, _ = run(make_runtime([b"a", b"S", b"T", b"x"]), stop_strings=["ST", "aSTOP"], max_tokens=3)
        assert (result.text, result.finish_reason) == ("a", "stop")

    def test_stop_string_in_markers(self):
        """A template marker spelled out in pieces ("<|" "end|>") stops like the token would."""
        result, _ = run(make_runtime([b"o", b"k", b"<|", b"end|>", b"z"]), stop_strings=["<|end|>"])
        assert (result.text, result.finish_reason) == ("ok", "stop")

    def test_held_back_tail_of_len_stop_minus_one(self):
        """"STO" (len("STOP") - 1 characters) is held back until "P" completes the stop string: neither
        the reply nor any streamed piece holds it."""
        result, pieces = run(make_runtime([b"x", b"S", b"T", b"O", b"P", b"y"]), stop_strings=["STOP"])
        assert (result.text, result.finish_reason) == ("x", "stop")
        assert pieces == ["x"]
        result, pieces = run(make_runtime([b"x", b"S", b"T", b"O", b"y"]), stop_strings=["STOP"])
        assert (result.text, pieces) == ("xSTOy", ["x", "STOy"])

    @given(text=st.text(alphabet="abc", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
           stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3))
    @example(text="aabc", cuts=[3], stops=["abc"])  # "ab", len(stop) - 1, must be held back at the cut
    def test_filter_against_str_find(self, text, cuts, stops):
        """StopStringFilter over any split of a text emits exactly text[:first stop] (str.find),
        and each emitted prefix is one no stop string could still extend into."""
        bounds = sorted(set([0, len(text)] + [c for c in cuts if c <= len(text)]))
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[:min(hits)] if hits else text
        stop_filter, emitted = StopStringFilter(stops), ""
        for chunk in chunks:
            out, stopped = stop_filter.push(chunk)
            emitted += out
            if stopped:
                break
        if not stop_filter.stopped:
            emitted += stop_filter.finish()[0]
        assert emitted == expected
        assert stop_filter.stopped == bool(hits)
        # the stop string it names is one that starts where the text was cut
        assert stop_filter.matched == (next(s for s in stops if text.find(s) == len(expected)) if hits else None)


class Utf8Tests:
    def test_character_split_across_tokens(self):
        """"é" as two byte tokens and "€" as two tokens: no piece ends inside a character."""
        result, pieces = run(make_runtime([b"c", b"a", b"f", b"\xc3", b"\xa9", b" ", b"\xe2\x82", b"\xac"]))
        assert result.text == "café €"
        assert pieces == ["c", "a", "f", "é", " ", "€"]

    def test_invalid_bytes_become_replacement_characters(self):
        """A stray byte becomes U+FFFD; a character cut off by the end of the reply too."""
        result, _ = run(make_runtime([b"a", b"\xff", b"b", b"\xe2\x82"]))
        assert result.text == "a\ufffdb\ufffd"

    def test_stop_string_after_multibyte(self):
        """Stop strings are matched on text, so one right after a split character works."""
        result, _ = run(make_runtime([b"\xc3", b"\xa9", b"S", b"T", b"OP"]), stop_strings=["STOP"])
        assert result.text == "é"


class PrefixReuseTests:
    def test_next_turn_evaluates_only_new_tokens(self):
        """A prompt that extends the previous prompt + reply evaluates only what is new, and
        cached_tokens counts the rest."""
        reply = ids(b"He", b"llo")
        longer = PROMPT + tuple(reply) + (EOS,) + tuple(ids(b"?"))
        runtime = make_runtime(scripts={PROMPT: reply, longer: ids(b"ld")})
        first, _ = run(runtime)
        assert first.cached_tokens == 0
        runtime.session.evals.clear()
        second, _ = run(runtime, prompt=longer)
        assert second.text == "ld"
        assert runtime.session.evals[0] == [EOS, tid(b"?")]  # the stop token was sampled, never evaluated
        assert second.cached_tokens == len(PROMPT) + len(reply)

    def test_reply_cut_by_length_runs_its_last_token_next_time(self):
        """A reply ended by max_tokens leaves its last token unevaluated; the next turn runs it."""
        reply = ids(b"He", b"llo")
        longer = PROMPT + tuple(reply) + (EOS,)
        runtime = make_runtime(scripts={PROMPT: reply, longer: ids(b"ld")})
        run(runtime, max_tokens=2)
        runtime.session.evals.clear()
        second, _ = run(runtime, prompt=longer)
        assert runtime.session.evals[0] == [reply[-1], EOS]
        assert (second.text, second.cached_tokens) == ("ld", len(PROMPT) + 1)

    def test_diverging_prompt_truncates_to_the_common_prefix(self):
        """A prompt that differs after k tokens keeps k, truncates, evaluates the rest."""
        other = tuple(ids(b"Q", b"!", b"?"))
        runtime = make_runtime(scripts={PROMPT: ids(b"a", b"b"), other: ids(b"c")})
        run(runtime)
        runtime.session.evals.clear()
        result, _ = run(runtime, prompt=other)
        assert runtime.session.truncations[-1] == 1
        assert runtime.session.evals[0] == ids(b"!", b"?")
        assert (result.text, result.cached_tokens) == ("c", 1)

    def test_prompt_differing_at_the_last_cached_token(self):
        """The cache holds P + [a]; the new prompt is P + [b], the same length and different only in
        its last token: it is truncated to P, evaluates b, and replies what a cold cache replies."""
        sampling = SamplingParams(temperature=1.0, seed=7)
        first = PROMPT + (tid(b"a"),)
        second = PROMPT + (tid(b"b"),)
        warm = make_runtime(noisy=True, scripts={})
        run(warm, prompt=first, sampling=sampling, max_tokens=1)
        assert warm.cached == list(first)  # the sampled token was not evaluated
        warm.session.evals.clear()
        warm_result, _ = run(warm, prompt=second, sampling=sampling, max_tokens=4)
        cold_result, _ = run(make_runtime(noisy=True, scripts={}), prompt=second, sampling=sampling, max_tokens=4)
        assert warm_result.tokens == cold_result.tokens
        assert warm.session.truncations == [len(PROMPT)]
        assert warm.session.evals[0] == [tid(b"b")]
        assert warm_result.cached_tokens == len(PROMPT)

    def test_repeat_history_reaches_exactly_repeat_last_n_back(self, monkeypatch):
        """The sampler is handed the last repeat_last_n tokens of the context: the one exactly
        repeat_last_n back included, none before it."""
        from krafla_twisted.generation import generate

        handed = []

        class Recording(generate.Sampler):
            def sample(self, logits, history=()):
                handed.append((list(history), list(runtime.cached)))
                return super().sample(logits, history)

        monkeypatch.setattr(generate, "Sampler", Recording)
        runtime = make_runtime(noisy=True, scripts={})
        prompt = PROMPT + tuple(ids(b"a", b"b", b"c", b"d", b"e"))
        run(runtime, prompt=prompt, sampling=SamplingParams(repeat_penalty=1.3, repeat_last_n=4), max_tokens=3)
        assert len(handed) == 3
        for history, context in handed:
            assert history == context[-4:] and len(history) == 4

    def test_same_prompt_twice(self):
        """The same prompt again reuses everything but re-runs its last token for the logits,
        and gives the same reply."""
        runtime = make_runtime([b"a", b"b"])
        first, _ = run(runtime)
        runtime.session.evals.clear()
        second, _ = run(runtime)
        assert second.text == first.text
        assert runtime.session.evals[0] == [PROMPT[-1]]
        assert second.cached_tokens == len(PROMPT) - 1

    def test_cache_tracks_the_session(self):
        """After any sequence of generations the remembered tokens equal the session's."""
        runtime = make_runtime(noisy=True, scripts={})
        for prompt in (PROMPT, PROMPT + (5, 6), (7,), PROMPT + (5,)):
            run(runtime, prompt=prompt, max_tokens=3)
            assert runtime.cached == runtime.session.tokens

    @settings(max_examples=25, deadline=None)
    @given(prompts=st.lists(st.lists(st.integers(2, 5), min_size=1, max_size=6), min_size=2, max_size=4),
           seed=st.integers(0, 2**64 - 1), batch=st.integers(1, 4))
    def test_warm_reply_equals_cold_reply(self, prompts, seed, batch):
        """Sampling at temperature 1 with a seed: every reply from a warm cache equals the reply
        to the same prompt from an empty one (the logits depend on the full history)."""
        warm = make_runtime(noisy=True, scripts={}, batch=batch)
        sampling = SamplingParams(temperature=1.0, top_p=0.95, repeat_penalty=1.1, seed=seed)
        for prompt in prompts:
            prompt = PROMPT + tuple(prompt)
            warm_result, _ = run(warm, prompt=prompt, sampling=sampling, max_tokens=4)
            cold_result, _ = run(make_runtime(noisy=True, scripts={}), prompt=prompt, sampling=sampling, max_tokens=4)
            assert warm_result.tokens == cold_result.tokens

    def test_seed_none_is_random_and_reported(self):
        """Without a seed each reply draws a fresh one and reports it; reusing it repeats the reply."""
        runtime = make_runtime(noisy=True, scripts={})
        sampling = SamplingParams(temperature=1.0)
        first, _ = run(runtime, sampling=sampling, max_tokens=6)
        second, _ = run(runtime, sampling=sampling, max_tokens=6)
        assert first.seed != second.seed
        again, _ = run(runtime, sampling=SamplingParams(temperature=1.0, seed=first.seed), max_tokens=6)
        assert again.tokens == first.tokens


# ------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct (pulled once into the krafla cache)


@pytest.fixture(scope="module")
def smollm():
    from tests.support.real_models import real_model

    return real_model("smollm2-135m")


def real_runtime(pulled, *, threads=1, batch=32, ctx=512):
    from krafla_twisted.engine.model import Model
    from krafla_twisted.engine.tokenizer import Tokenizer

    return Runtime(Model(str(pulled.mlb), threads=threads), Tokenizer(str(pulled.mlt)), templates.get_template("smollm"),
                   ctx=ctx, batch=batch)


class RealModelTests:
    def test_greedy_answer(self, smollm):
        """Greedy chat with SmolLM2: the capital of France is Paris, ended by <|im_end|>."""
        with real_runtime(smollm) as runtime:
            prompt = runtime.template.render([{"role": "user", "content": "What is the capital of France?"}],
                                             runtime.tokenizer)
            result = Generator(runtime).generate(prompt, max_tokens=40, sampling=SamplingParams())
            assert result.text == runtime.tokenizer.decode(list(result.tokens)).decode()
        assert "Paris" in result.text
        assert result.finish_reason == "stop"

    def test_warm_cache_reply_equals_cold(self, smollm):
        """Second turn of a sampled chat: the reply from the warm KV cache (which reused the first
        turn's prompt and reply) is bitwise the reply from an empty cache with another batch size
        and thread count; the next prompt starts with prompt + reply tokens + <|im_end|>."""
        sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, repeat_penalty=1.1, seed=1234)
        conversation = [{"role": "user", "content": "Name three fruits."}]
        with real_runtime(smollm, threads=2, batch=32) as warm:
            template, tokenizer = warm.template, warm.tokenizer
            first_prompt = template.render(conversation, tokenizer)
            first = Generator(warm).generate(first_prompt, max_tokens=24, sampling=sampling)
            conversation += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And two more?"}]
            second_prompt = template.render(conversation, tokenizer)
            reply_ids = tokenizer.encode(first.text, add_bos=False)
            assert second_prompt[:len(first_prompt)] == first_prompt
            assert second_prompt[len(first_prompt):len(first_prompt) + len(reply_ids)] == reply_ids
            assert second_prompt[len(first_prompt) + len(reply_ids)] == tokenizer.token_id("<|im_end|>")
            warm_second = Generator(warm).generate(second_prompt, max_tokens=24, sampling=sampling)
        assert warm_second.cached_tokens >= len(first_prompt)
        with real_runtime(smollm, threads=1, batch=5) as cold:
            cold_second = Generator(cold).generate(second_prompt, max_tokens=24, sampling=sampling)
        assert cold_second.cached_tokens == 0
        assert warm_second.tokens == cold_second.tokens
        assert warm_second.text == cold_second.text
