"""The scheduler (krafla_twisted/generation/scheduler.py) with real tiny models: a request's reply beside
others is bitwise the reply it gets alone, and a new request takes the right slot.

"Alone" is Generator.generate on a one-slot Runtime, the path `krafla run` and `--parallel 1` take.
"Beside others" is the Scheduler on a Runtime of 2, 4 or 8 slots with 1, 3 or 7 random other
requests joining at random steps (so the requests' prompts and replies line up differently in each
forward step), some of them cancelled midway, some with stop strings, some sharing a prompt prefix.
Every step's logits are recorded through a pass-through constraint, so the comparison is of the
logits' bits, not only of the tokens sampled from them.
"""

import zlib

import numpy as np
import pytest

from krafla_twisted.engine.model import Model
from krafla_twisted.generation.generate import Generation, Generator, Runtime, SamplingParams, run_alone
from krafla_twisted.generation.scheduler import Scheduler
from tests.support.letters import LetterTokenizer, RecordingConstraint
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35


def request(rng, n_vocab, shared):
    """A random request: prompt (often continuing `shared`), sampling, limits, stop strings, cancel point."""
    prompt = list(rng.integers(0, n_vocab, size=int(rng.integers(1, 40))))
    if rng.random() < 0.4:
        prompt = shared[:int(rng.integers(1, len(shared) + 1))] + prompt[:int(rng.integers(0, 6))]
    sampling = SamplingParams(temperature=0.0) if rng.random() < 0.5 else \
        SamplingParams(temperature=0.9, top_p=0.95, seed=int(rng.integers(0, 2**32)))
    stop = ("".join(chr(ord("a") + int(t)) for t in rng.integers(0, 4, size=2)),) if rng.random() < 0.3 else ()
    cancel_after = int(rng.integers(1, 5)) if rng.random() < 0.25 else None
    return dict(prompt=[int(t) for t in prompt], sampling=sampling, max_tokens=int(rng.integers(1, 12)), stop=stop,
                cancel_after=cancel_after)


def generation(runtime, spec):
    """The Generation of a request spec, recording its logits and cancelling itself after `cancel_after` pieces."""
    constraint = RecordingConstraint()
    pieces = []
    cancel_after = spec["cancel_after"]
    made = Generation(runtime, spec["prompt"], max_tokens=spec["max_tokens"], sampling=spec["sampling"],
                      stop_strings=spec["stop"], on_text=pieces.append, constraint=constraint,
                      cancelled=lambda: cancel_after is not None and len(pieces) >= cancel_after)
    return made, constraint


def outcome(result, constraint):
    return (result.text, result.finish_reason, result.tokens, result.completion_tokens,
            [logits.view(np.uint32).tobytes() for logits in constraint.logits])


def alone(model, tokenizer, spec):
    runtime = Runtime(model, tokenizer, ctx=96, kv=spec["kv"], batch=8)
    try:
        made, constraint = generation(runtime, spec)
        return outcome(run_alone(made), constraint)
    finally:
        for slot in runtime.slots:
            slot.session.close()


def beside_others(model, tokenizer, spec, others, rng):
    """The target request's outcome when it and `others` run in one Scheduler, joining at random steps."""
    runtime = Runtime(model, tokenizer, ctx=96, kv=spec["kv"], batch=8, parallel=int(rng.choice([2, 4, 8])))
    try:
        scheduler = Scheduler(runtime)
        arrivals = [spec] + list(others)
        rng.shuffle(arrivals)
        made = {}
        while arrivals or scheduler.busy:
            while arrivals and (not scheduler.busy or rng.random() < 0.4):
                joining = arrivals.pop()
                made[id(joining)] = generation(runtime, joining)
                scheduler.add(made[id(joining)][0])
            for ended in scheduler.step():
                assert ended.error is None, ended.error
        target, constraint = made[id(spec)]
        return outcome(target.result, constraint)
    finally:
        for slot in runtime.slots:
            slot.session.close()


def write(path, arch):
    if arch == "qwen35":
        return write_tiny_qwen35(path, seed=5, weight_type="q4_0", head_dim=32)
    write_tiny_model(path, arch, seed=5, weight_type="q4_0", head_dim=32)
    return path


class SchedulerTests:
    @pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
    @pytest.mark.parametrize("arch", ARCHS + ("qwen35",))
    def test_alone_equals_beside_others(self, tmp_path, arch, kv):
        """For three random requests (T=0 or T>0 with a seed, stop strings, cancellation, shared prefixes):
        beside 1, 3 and 7 random others joining at random steps, in 2 to 8 slots with prompts chunked by a
        budget of 8 tokens per step, every step's logits, the tokens and the text equal, bit for bit,
        what the request gets alone (Generator's one-slot path) on 2 threads."""
        rng = np.random.default_rng(zlib.crc32(f"{arch} {kv}".encode()))
        with Model(write(tmp_path / "m.mlb", arch), threads=2) as model:
            tokenizer = LetterTokenizer(model.n_vocab)
            shared = [int(t) for t in rng.integers(0, model.n_vocab, size=30)]
            for _ in range(3):
                spec = dict(request(rng, model.n_vocab, shared), kv=kv)
                want = alone(model, tokenizer, spec)
                assert want[4], "the request sampled no token: nothing compared"
                for n_others in (1, 3, 7):
                    others = [dict(request(rng, model.n_vocab, shared), kv=kv) for _ in range(n_others)]
                    got = beside_others(model, tokenizer, spec, others, rng)
                    assert got[:4] == want[:4], (n_others, got[:4], want[:4])
                    assert got[4] == want[4], f"beside {n_others} others the logits differ"

    def test_generator_is_run_alone(self, tmp_path):
        """Generator.generate (what `krafla run` calls) gives the reply the scheduler gives a request on its own."""
        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            tokenizer = LetterTokenizer(model.n_vocab)
            sampling = SamplingParams(temperature=0.7, seed=11)
            direct = Generator(Runtime(model, tokenizer, ctx=64)).generate([3, 1, 4, 1, 5], max_tokens=9,
                                                                            sampling=sampling)
            with_slots = Runtime(model, tokenizer, ctx=64, parallel=3)
            scheduler = Scheduler(with_slots)
            made = Generation(with_slots, [3, 1, 4, 1, 5], max_tokens=9, sampling=sampling)
            scheduler.add(made)
            while scheduler.busy:
                scheduler.step()
            assert (made.result.text, made.result.tokens) == (direct.text, direct.tokens)
            assert len(direct.tokens) == 9


class SlotChoiceTests:
    def runtime(self, model, parallel=3):
        return Runtime(model, LetterTokenizer(model.n_vocab), ctx=64, parallel=parallel)

    def run(self, runtime, scheduler, prompt):
        made = Generation(runtime, prompt, max_tokens=2, sampling=SamplingParams())
        scheduler.add(made)
        while scheduler.busy:
            scheduler.step()
        return made

    def test_longest_prefix_then_least_recently_used(self, tmp_path):
        """A request takes the free slot whose cache shares the longest prefix with its prompt, and reports
        those tokens as cached; with no prefix anywhere it takes the least recently used slot."""
        with Model(write(tmp_path / "m.mlb", "qwen3"), threads=1) as model:
            runtime = self.runtime(model)
            scheduler = Scheduler(runtime)
            first = self.run(runtime, scheduler, [1, 2, 3, 4, 5, 6])
            second = self.run(runtime, scheduler, [9, 9, 9])
            third = self.run(runtime, scheduler, [7, 7])
            assert [g.slot.index for g in (first, second, third)] == [0, 1, 2]  # empty slots, least recently used
            assert [g.result.cached_tokens for g in (first, second, third)] == [0, 0, 0]
            again = self.run(runtime, scheduler, [9, 9, 9, 8, 8])
            assert (again.slot.index, again.result.cached_tokens) == (1, 3)
            longer = self.run(runtime, scheduler, [1, 2, 3, 4, 0])
            assert (longer.slot.index, longer.result.cached_tokens) == (0, 4)
            fresh = self.run(runtime, scheduler, [50, 51])  # no prefix anywhere: slot 2 was used longest ago
            assert (fresh.slot.index, fresh.result.cached_tokens) == (2, 0)

    def test_short_prefix_does_not_evict_a_longer_cache(self, tmp_path):
        """A prompt that keeps less than half of a slot's cache (say, only a chat template's header) takes
        the least recently used slot instead, so the longer cache survives for its own follow-up; the
        shared tokens are copied into the slot it takes, and count as cached."""
        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            runtime = self.runtime(model, parallel=2)
            scheduler = Scheduler(runtime)
            conversation = self.run(runtime, scheduler, list(range(1, 11)))
            other = self.run(runtime, scheduler, [1, 2, 50])
            assert (conversation.slot.index, other.slot.index, other.result.cached_tokens) == (0, 1, 2)
            follow_up = self.run(runtime, scheduler, list(range(1, 11)) + list(conversation.result.tokens[:1]) + [60])
            assert (follow_up.slot.index, follow_up.result.cached_tokens) == (0, 11)

    @pytest.mark.parametrize("arch", ARCHS)
    def test_prefix_copied_from_a_busy_slot(self, tmp_path, arch):
        """A request arriving while another runs gets the prefix they share copied from the running one's
        slot (the copy stops before its last prompt token, which runs for its logits); both replies are
        the bits each gets alone, and the running one is not disturbed."""
        with Model(write(tmp_path / "m.mlb", arch), threads=2) as model:
            tokenizer = LetterTokenizer(model.n_vocab)
            sampling = SamplingParams(temperature=0.8, seed=5)
            header = [7, 3, 9, 12, 4, 4, 30, 2, 8, 16, 5, 11]
            prompts = (header + [40, 41, 42], header + [50])
            want = [Generator(Runtime(model, tokenizer, ctx=64)).generate(p, max_tokens=10, sampling=sampling)
                    for p in prompts]
            runtime = self.runtime(model, parallel=3)
            scheduler = Scheduler(runtime)
            running = Generation(runtime, prompts[0], max_tokens=10, sampling=sampling)
            scheduler.add(running)
            for _ in range(3):
                scheduler.step()
            assert not running.done and not running.prefilling
            joining = Generation(runtime, prompts[1], max_tokens=10, sampling=sampling)
            scheduler.add(joining)
            while scheduler.busy:
                scheduler.step()
            assert (running.slot.index, joining.slot.index) == (0, 1)
            assert (running.result.cached_tokens, joining.result.cached_tokens) == (0, len(header))
            for made, alone in zip((running, joining), want):
                assert (made.result.text, made.result.tokens) == (alone.text, alone.tokens)

    def test_no_prefix_copies_for_qwen35(self, tmp_path):
        """Qwen3.5's recurrent state exists only for a session's last position: nothing is copied between
        its slots (the first try finds out), and a request sharing a header takes a fresh slot as before."""
        with Model(write(tmp_path / "m.mlb", "qwen35"), threads=1) as model:
            runtime = self.runtime(model, parallel=2)
            scheduler = Scheduler(runtime)
            self.run(runtime, scheduler, list(range(1, 11)))
            other = self.run(runtime, scheduler, [1, 2, 50])
            assert (other.slot.index, other.result.cached_tokens, runtime.prefix_copies) == (1, 0, False)

    def test_busy_slots_not_chosen(self, tmp_path):
        """Requests running side by side each hold their own slot; one more waits until a slot is free,
        then takes the one with its prefix."""
        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            runtime = self.runtime(model, parallel=2)
            scheduler = Scheduler(runtime)
            made = [Generation(runtime, prompt, max_tokens=max_tokens, sampling=SamplingParams())
                    for prompt, max_tokens in (([5, 6, 7], 2), ([5, 6, 7, 8], 6), ([5, 6, 7], 2))]
            for generation in made:
                scheduler.add(generation)
            scheduler.step()
            assert (scheduler.slots_busy, scheduler.waiting_count) == (2, 1)
            assert made[0].slot is not made[1].slot
            while scheduler.busy:
                scheduler.step()
            assert made[2].slot is made[0].slot  # the free one: made[1] still ran when made[2] got a slot
            assert made[2].result.cached_tokens == 2  # all 3 cached; the last runs again for its logits
            assert sum(scheduler.batch_histogram) == scheduler.steps and scheduler.batch_histogram[2] > 0


class AbandonTests:
    def test_a_failing_step_ends_every_generation(self, tmp_path):
        """When a step fails outside any one generation (a bug), abandon() ends the running and the waiting
        generations with the error, frees their slots and forgets the caches they left half written."""
        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            runtime = Runtime(model, LetterTokenizer(model.n_vocab), ctx=64, parallel=1)
            scheduler = Scheduler(runtime)
            made = [Generation(runtime, [1, 2, 3], max_tokens=8) for _ in range(2)]
            for generation in made:
                scheduler.add(generation)
            scheduler.step()
            error = RuntimeError("a bug")
            ended = scheduler.abandon(error)
            assert sorted(map(id, ended)) == sorted(map(id, made))
            assert all(g.done and g.error is error for g in made)
            assert not scheduler.busy and not runtime.slots[0].busy
            assert runtime.slots[0].cached == [] and runtime.session.n_tokens == 0

    def test_cancelled_before_a_slot(self, tmp_path):
        """A generation whose client leaves while every slot is busy is skipped (it never starts); one that
        leaves before its first step while a slot is free ends as a cancelled prompt (its prompt counted,
        no reply) and leaves the slot's cache as it was."""
        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            runtime = Runtime(model, LetterTokenizer(model.n_vocab), ctx=64, parallel=1)
            scheduler = Scheduler(runtime)
            gone = []
            running = Generation(runtime, [1, 2, 3], max_tokens=4)
            waiting = Generation(runtime, [4, 5], max_tokens=4, cancelled=lambda: "waiting" in gone)
            scheduler.add(running)
            scheduler.add(waiting)
            scheduler.step()
            gone.append("waiting")
            assert scheduler.step() == [waiting] and waiting.skipped and waiting.slot is None
            while scheduler.busy:
                scheduler.step()
            cached = list(runtime.slots[0].cached)
            late = Generation(runtime, [1, 2, 9], max_tokens=4, cancelled=lambda: True)
            scheduler.add(late)
            assert scheduler.step() == [late] and not late.skipped
            assert (late.result.finish_reason, late.result.prompt_tokens, late.result.completion_tokens) == ("cancelled", 3, 0)
            assert runtime.slots[0].cached == cached


class RuntimeSlotsTests:
    def test_a_slot_that_cannot_be_made_is_named(self, tmp_path):
        """A session the engine refuses (here a context out of its range) stops the Runtime with an error naming
        the slot and the options, and the slots already made are closed; parallel must be a positive integer."""
        from krafla_twisted.engine import clib

        with Model(write(tmp_path / "m.mlb", "llama"), threads=1) as model:
            with pytest.raises(clib.KraflaError, match=r"cannot make slot 1 of 3 \(--parallel 3, --ctx 2147483647, "
                                                       r"--kv f32\): context 2147483647 is out of range"):
                Runtime(model, LetterTokenizer(model.n_vocab), ctx=2**31 - 1, parallel=3)
            with pytest.raises(ValueError, match="parallel must be an integer >= 1, not 0"):
                Runtime(model, LetterTokenizer(model.n_vocab), parallel=0)
