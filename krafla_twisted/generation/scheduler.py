"""Continuous batching: many generations side by side in the runtime's slots, one forward step at a time.

    scheduler = Scheduler(runtime)              # runtime = Runtime(..., parallel=4)
    scheduler.add(Generation(runtime, prompt_a, ...))
    scheduler.add(Generation(runtime, prompt_b, ...))
    while scheduler.busy:
        for generation in scheduler.step():     # the ones that ended in this step
            print(generation.result.text)

Each step first admits waiting generations, in arrival order, into free slots (the slot whose
cache shares the longest prefix with the prompt, then the least recently used: Runtime.choose_slot),
then runs ONE Model.eval_batch over every active generation: the next token of each running reply
("last") and chunks of prompts still being read (chunked prefill: the prompts share what is left of
a budget of runtime.batch tokens per step after the replies' tokens, so a long prompt does not
stall the others' streams). Then each generation samples with its own sampler and seed.

The engine gives every sequence of a step the logits it gets alone, and the same logits however a
prompt is chunked, so a generation's reply is bitwise the one it gets run alone
(generate.run_alone), whatever else runs beside it and at any step alignment.

Everything here runs in the one thread that owns the runtime (the server's worker). The counters
(`slots_busy`, `waiting_count`, `steps`, `batch_histogram`, ...) are plain ints that another thread
may read for /metrics.
"""

import collections
from dataclasses import dataclass

from krafla_twisted.engine.model import logits_blocks

# --parallel's default: see docs/server.md ("Slots and batching") for the measurement behind it.
DEFAULT_PARALLEL = 4


@dataclass(frozen=True)
class Pending:
    """A generation to run with the scheduler and what its caller gets at the end:
    `conclude(generation)` returns the result, or raises the error to report."""

    generation: object
    conclude: object


class Scheduler:
    def __init__(self, runtime):
        self.runtime = runtime
        self.waiting = collections.deque()   # generations without a slot, in arrival order
        self.active = []                     # generations in a slot, in admission order
        self.steps = 0                       # forward steps run
        self.batch_sequences_total = 0       # sum over steps of the sequences in each
        self.batch_tokens_total = 0          # sum over steps of the tokens in each
        self.last_batch_sequences = 0
        self.batch_histogram = [0] * (runtime.parallel + 1)  # steps by how many sequences they held

    @property
    def parallel(self):
        return self.runtime.parallel

    @property
    def busy(self):
        """Whether any generation waits or runs."""
        return bool(self.waiting or self.active)

    @property
    def slots_busy(self):
        return len(self.active)

    @property
    def waiting_count(self):
        return len(self.waiting)

    def add(self, generation):
        """Queue a generation; it joins at the next step that finds a free slot."""
        self.waiting.append(generation)

    def step(self):
        """Admit what fits, run one forward step over every active generation, sample each; return the
        generations that ended (their slots are free again). A generation whose evaluation fails
        ends with `generation.error` set; the others go on."""
        ended = self._admit()
        for generation in [g for g in self.waiting if g.cancelled()]:
            # Its client left while every slot was busy: it never started.
            self.waiting.remove(generation)
            generation.skipped = True
            generation.cancel()
            ended.append(generation)
        items = self._inputs()
        if items:
            self._evaluate(items)
        for generation in [g for g in self.active if g.done]:
            self.active.remove(generation)
            self.runtime.release_slot(generation.slot)
            ended.append(generation)
        return ended

    def abandon(self, error):
        """End every generation, waiting or active, with `error` (a bug in a step: no request may hang);
        returns them, their slots free again and their caches forgotten."""
        ended = list(self.waiting) + self.active
        for generation in self.active:
            try:
                generation.slot.reset()
            except Exception:
                pass  # the slot's session is what failed: its cache is already unusable
            self.runtime.release_slot(generation.slot)
        for generation in ended:
            if not generation.done:
                generation.fail(error)
        self.waiting.clear()
        self.active = []
        return ended

    def _admit(self):
        """Give free slots to waiting generations in arrival order; returns those that ended at once
        (cancelled before their first step: they report their prompt, as a cancelled prefill does,
        and leave the slot's cache untouched)."""
        ended = []
        while self.waiting and any(not slot.busy for slot in self.runtime.slots):
            generation = self.waiting.popleft()
            if generation.cancelled():
                generation.cancel()
                ended.append(generation)
                continue
            slot = self.runtime.choose_slot(generation.prompt)
            self.active.append(generation)
            try:
                generation.attach(slot)
            except Exception as e:
                generation.fail(e)
        return ended

    def _inputs(self):
        """(generation, token ids, logits mode) of this step: one token per running reply (with the
        tokens its speculation proposes, each reply's share of the step's budget), then prompt chunks
        in admission order from what is left of the budget (at least one token)."""
        replies = [g for g in self.active if not g.done and not g.prefilling]
        prompts = [g for g in self.active if not g.done and g.prefilling]
        # Each reply may fill an even share of the step with proposed tokens: of half of it while prompts
        # are being read, so speculation does not starve their prefill.
        room = self.runtime.batch // 2 if prompts else self.runtime.batch
        share = max(1, room // max(1, len(replies)))
        budget = self.runtime.batch
        items = []
        for generation in replies:
            wanted = generation.next_input(share)
            if wanted is not None and wanted[0]:
                budget -= len(wanted[0])
                items.append((generation, *wanted))
        budget = max(budget, 1)
        for generation in prompts:
            wanted = generation.next_input(budget)
            if wanted is None or not wanted[0]:
                continue
            budget -= len(wanted[0])
            items.append((generation, *wanted))
        return items

    def _evaluate(self, items):
        model = self.runtime.model
        # The "last" rows of one buffer, one after the other: the engine then runs the output head
        # once for the whole step (one matrix-matrix product) instead of once per sequence, which
        # costs as many passes over the largest matrix as there are replies.
        counts = [{"none": 0, "last": 1, "all": len(tokens)}[mode] for _, tokens, mode in items]
        blocks = logits_blocks(counts, model.n_vocab)
        batch = [(g.slot.session, tokens, mode) + ((out,) if out is not None else ())
                 for (g, tokens, mode), (out, _) in zip(items, blocks)]
        try:
            model.eval_batch(batch)
        except Exception as e:
            # No session changed: each generation of the step ends with the error.
            for generation, _, _ in items:
                generation.fail(e)
            return
        self.steps += 1
        self.last_batch_sequences = len(items)
        self.batch_sequences_total += len(items)
        self.batch_tokens_total += sum(len(tokens) for _, tokens, _ in items)
        self.batch_histogram[min(len(items), len(self.batch_histogram) - 1)] += 1
        for (generation, _, mode), (out, rows) in zip(items, blocks):
            try:
                generation.feed(rows if mode == "all" else out)
            except Exception as e:  # a grammar that fails, a callback that raises: this generation's error
                generation.fail(e)
