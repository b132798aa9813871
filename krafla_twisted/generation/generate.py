"""One generation, shared by `krafla run` and the server: prefix reuse, sampling, stop tokens and
stop strings, UTF-8 pieces.

    runtime = Runtime(model, tokenizer, template)    # or startup.load_runtime(options)
    prompt = build_prompt(runtime, messages=[{"role": "user", "content": "Hi"}], stop=("\\n\\n",))
    result = Generator(runtime).generate(prompt.tokens, max_tokens=64, sampling=SamplingParams(),
                                         stop_strings=prompt.stop_strings, on_text=print)

Everything here runs in one thread (the server's worker): the Runtime's sessions (its slots) are
not shared. A Generation is one reply as a state machine: Generator.generate runs one alone,
krafla_twisted/generation/scheduler.py runs many side by side, one slot each.
This module knows neither command-line options nor downloads (krafla_twisted/cli/startup.py turns
those into a Runtime).

KV prefix reuse: each slot remembers the tokens whose keys and values are in its session. A new
prompt keeps their longest common prefix, truncates the rest and evaluates only the new tokens;
the engine gives identical logits however a prefix got into the cache, so a warm request gets
bitwise the reply a cold one gets.

Stop strings: the reply ends before the first occurrence of any stop string, even one spread over
several tokens. Text that could still turn out to be the start of a stop string is held back;
`on_text` only ever sees text that will stay in the reply, in whole characters.
"""

import dataclasses
import math
import secrets
import time
from dataclasses import dataclass

from krafla_twisted.chat import templates
from krafla_twisted.engine import clib, header, sampler
from krafla_twisted.engine.model import copy_logits, logits_blocks
from krafla_twisted.engine.sampler import Sampler


class ContextLengthExceeded(ValueError):
    """The prompt does not fit the context (with room for at least one reply token).

    The message begins as OpenAI's does ("This model's maximum context length is N tokens.
    However, ..."): clients that recognise the error by its text (litellm, and aider through it)
    then raise their context-window error instead of a generic one.
    """

    def __init__(self, n_prompt, n_ctx):
        super().__init__(f"This model's maximum context length is {n_ctx} tokens. However, the prompt has "
                         f"{n_prompt} tokens (prompt and reply share the context, so a prompt may have at most "
                         f"{n_ctx - 1}). Please shorten the prompt.")
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 0.9
    top_k: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = None  # None: a new random seed for each generation
    frequency_penalty: float = 0.0  # OpenAI's: count in the last repeat_last_n tokens times this is subtracted
    presence_penalty: float = 0.0   # subtracted once from every token among them
    min_p: float = 0.0              # after top-p: drop tokens less likely than min_p times the best one

    @property
    def penalises(self):
        """Whether any penalty looks at the history."""
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def check(self):
        """Raise ValueError naming the first bad field; return self."""
        def number(name, value, ok, expected):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise ValueError(f"{name} must be {expected}, not {value!r}")

        def integer(name, value, ok, expected):
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(f"{name} must be {expected}, not {value!r}")

        number("temperature", self.temperature, lambda v: v >= 0, "a number >= 0")
        number("top_p", self.top_p, lambda v: 0 <= v <= 1, "a number from 0 to 1")
        integer("top_k", self.top_k, lambda v: 0 <= v < 2**31, "an integer >= 0")
        number("repeat_penalty", self.repeat_penalty, lambda v: v > 0, "a number > 0")
        integer("repeat_last_n", self.repeat_last_n, lambda v: -1 <= v < 2**31, "an integer >= -1")
        number("frequency_penalty", self.frequency_penalty, lambda v: -2 <= v <= 2, "a number from -2 to 2")
        number("presence_penalty", self.presence_penalty, lambda v: -2 <= v <= 2, "a number from -2 to 2")
        number("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number from 0 to 1")
        if self.seed is not None:
            integer("seed", self.seed, lambda v: 0 <= v < 2**64, "an integer from 0 to 2**64 - 1")
        return self


@dataclass(frozen=True)
class GenerationResult:
    text: str
    finish_reason: str          # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens whose KV came from the previous generation
    prompt_seconds: float
    generation_seconds: float
    tokens: tuple = ()          # the reply's token ids (a stop token is not included)
    seed: int = None            # the seed the sampler used
    logprobs: tuple = ()        # TokenLogprobs of the reply's tokens, when asked for
    stop_string: str = None     # the stop string the reply was cut at (None: it ended otherwise)
    proposed_tokens: int = 0    # tokens speculation proposed (krafla_twisted/generation/speculate.py)
    accepted_tokens: int = 0    # of those, the ones the model's own sampling confirmed
    prompt_logprobs: tuple = () # TokenLogprobs of the prompt's tokens after the first, when asked for

    @property
    def prompt_tokens_per_second(self):
        evaluated = self.prompt_tokens - self.cached_tokens
        return evaluated / self.prompt_seconds if self.prompt_seconds > 0 else math.inf

    @property
    def completion_tokens_per_second(self):
        return self.completion_tokens / self.generation_seconds if self.generation_seconds > 0 else math.inf


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability and the `top` most likely tokens' ((id, logprob), ...),
    from the log-softmax of the model's logits before penalties, bias and grammar masks."""

    token: int
    logprob: float
    top: tuple = ()


def token_logprob(logits, token, top):
    """The TokenLogprob of `token` under `logits` (the model's, unmodified) with `top` alternatives;
    ties among the top are ordered by token id."""
    logprob, best = sampler.logprobs(logits, token, top)
    return TokenLogprob(int(token), logprob, best)


def apply_logit_bias(logits, logit_bias):
    """Add OpenAI's logit_bias ({token id: -100..100}) to a copy of `logits`; -100 bans a token."""
    biased = copy_logits(logits)
    for token, bias in logit_bias.items():
        biased[token] = -math.inf if bias <= -100 else biased[token] + bias
    return biased


# ---------------------------------------------------------------------------------------------
# Stop strings


class StopStringFilter:
    """Feeds text through, holding back any tail that could still become a stop string.

    push(text) -> (text safe to emit, stopped). The reply is cut before the earliest occurrence
    of any stop string in the whole text: a complete match is acted on only once no stop string
    that would start earlier can still complete. `finish()` -> (rest, stopped) when the reply
    ends for another reason. After a stop nothing more is accepted; `matched` is the stop string
    the text was cut at (the first of them in order, when several start there).
    """

    def __init__(self, stop_strings):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.pending = ""
        self.stopped = False
        self.matched = None

    def push(self, text):
        if self.stopped:
            return "", True
        self.pending += text
        complete = self._first_complete()
        partial = self._first_partial()
        if complete is not None and (partial is None or partial > complete):
            return self._stop_at(complete)
        cut = len(self.pending) if partial is None else partial
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def finish(self):
        """The held-back rest at the end of the reply, cut at a stop string if it has one."""
        if self.stopped:
            return "", True
        complete = self._first_complete()
        if complete is not None:
            return self._stop_at(complete)
        out, self.pending = self.pending, ""
        return out, False

    def _stop_at(self, position):
        self.matched = next(s for s in self.stop_strings if self.pending.startswith(s, position))
        out, self.pending, self.stopped = self.pending[:position], "", True
        return out, True

    def _first_complete(self):
        found = [i for i in (self.pending.find(s) for s in self.stop_strings) if i >= 0]
        return min(found) if found else None

    def _first_partial(self):
        """The earliest position whose tail is a proper prefix of a stop string, or None."""
        best = None
        size = len(self.pending)
        for stop in self.stop_strings:
            for start in range(max(0, size - len(stop) + 1), size):
                if best is not None and start >= best:
                    break
                if stop.startswith(self.pending[start:]):
                    best = start
                    break
        return best


# ---------------------------------------------------------------------------------------------
# Runtime: the loaded model, its sessions (slots) and the tokens in each


# Bytes per cached value of each KV type (q8_0: blocks of 32 values, 32 bytes and a 2-byte scale).
KV_VALUE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def kv_cache_bytes(model, n_ctx, kv):
    """The keys and values of one slot of `n_ctx` positions: layers x positions x 2 x KV heads x head_dim."""
    values = 2 * model.n_layers * n_ctx * model.n_kv_heads * model.head_dim
    return int(values * KV_VALUE_BYTES.get(kv, 4.0))


class Slot:
    """One Session and the tokens whose keys and values are in it, kept between requests so the
    next prompt that shares a prefix with them evaluates only the rest. A slot serves one
    generation at a time; `last_used` orders the free slots for reuse (least recently used first)."""

    def __init__(self, session, index=0):
        self.session = session
        self.index = index
        self.cached = []            # token ids whose KV is in the session, in order
        self.cached_logits = None   # logits after the last of them, when known
        self.last_used = 0
        self.busy = False

    def common_prefix(self, prompt):
        """How many leading tokens of `prompt` are in this slot's cache."""
        common = 0
        for cached, wanted in zip(self.cached, prompt):
            if cached != wanted:
                break
            common += 1
        return common

    def reset(self):
        """Forget the KV cache (the next prompt is evaluated from scratch)."""
        self.session.truncate(0)
        self.cached = []
        self.cached_logits = None


class Runtime:
    """A Model, `parallel` Sessions over it (slots, each with its own KV cache), the Tokenizer, the
    chat Template (or None) and the defaults a request falls back on (sampling, max_tokens, system
    prompt). It owns the model and closes it in close()."""

    def __init__(self, model, tokenizer, template=None, *, ctx=None, kv="f32", batch=32, eos=None,
                 sampling=SamplingParams(), max_tokens=0, system=None, threads=None, parallel=1, speculation=None):
        if tokenizer.n_vocab != model.n_vocab:
            raise ValueError(f"the tokenizer has {tokenizer.n_vocab} tokens but the model {model.n_vocab}: "
                             "they do not belong together")
        if eos is not None and not 0 <= eos < model.n_vocab:
            raise ValueError(f"the end-of-reply token {eos} is not a token id of this model (0..{model.n_vocab - 1})")
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1, not {parallel!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.template_from = None   # where the template's name came from: "--chat", "the tokenizer file", ...
        self.kv = kv
        self.batch = batch
        self.threads = threads if threads is not None else getattr(model, "threads", None)
        self.sampling = sampling.check()
        self.max_tokens = max_tokens
        self.system = system
        self.slots = []
        try:
            for index in range(parallel):
                self.slots.append(Slot(model.session(ctx=ctx, kv=kv, batch=batch), index))
        except clib.KraflaError as e:
            for slot in self.slots:
                slot.session.close()
            hint = "; lower --parallel or --ctx, or use a smaller --kv type" if e.status == header.KR_ERR_MEMORY else ""
            raise clib.KraflaError(f"cannot make slot {len(self.slots) + 1} of {parallel} (--parallel {parallel}, "
                                   f"--ctx {ctx or 'default'}, --kv {kv}): {e}{hint}", e.status) from None
        stops = set(tokenizer.eot_ids) if eos is None else {eos}
        if eos is None and tokenizer.eos_id is not None:
            stops.add(tokenizer.eos_id)
        if template is not None:
            stops |= template.stop_token_ids(tokenizer)
        self.stop_token_ids = frozenset(stops)
        self.prefix_copies = True   # seed_slot copies prefixes between slots (not Qwen3.5's sessions)
        self.speculation = speculation  # a speculate.Speculation (owned: closed with the runtime), or None
        self._uses = 0

    @property
    def parallel(self):
        return len(self.slots)

    @property
    def isa(self):
        """The instruction set the loaded library's kernels were built for: avx512, avx2 or generic."""
        return clib.loaded_isa()

    @property
    def kv_bytes_per_slot(self):
        return kv_cache_bytes(self.model, self.n_ctx, self.kv)

    # The first slot: what `krafla run` (one sequence) and single-session tests look at.
    @property
    def session(self):
        return self.slots[0].session

    @property
    def cached(self):
        return self.slots[0].cached

    @property
    def cached_logits(self):
        return self.slots[0].cached_logits

    @property
    def n_ctx(self):
        return self.session.n_ctx

    def choose_slot(self, prompt):
        """The free slot for `prompt`, marked busy until release_slot; None when every slot is busy.

        The slot whose cache shares the longest prefix with the prompt, then the least recently used
        (an unused one first). A prefix counts only if it is at least half of what the slot holds:
        otherwise a new chat, sharing just the chat template's header with a conversation in a
        slot, would take that slot and lose the conversation's cache while another slot is free
        to lose less."""
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            return None

        def reused(slot):
            common = slot.common_prefix(prompt)
            return common if 2 * common >= len(slot.cached) else 0

        best = max(free, key=lambda slot: (reused(slot), -slot.last_used, -slot.index))
        best.busy = True
        return best

    def seed_slot(self, slot, prompt, keep):
        """Give `slot`, about to hold `prompt`, a longer prefix of it than the `keep` tokens of its own
        cache it would keep, when another slot (free or busy) holds one: that many positions of the
        other slot's KV cache are copied in (Session.copy_prefix), at most all but the prompt's last
        token, and the other slot is not touched. So a new chat that shares only the chat template's
        header with a conversation gets the header from that conversation's slot while
        choose_slot gave it another. Returns how many tokens `slot` now holds for the prompt, or
        None when no slot held more than `keep` or the model's sessions cannot be copied (Qwen3.5)."""
        if not self.prefix_copies:
            return None
        donor, shared = None, keep
        for other in self.slots:
            if other is not slot and len(other.cached) > shared:
                common = min(other.common_prefix(prompt), len(prompt) - 1)
                if common > shared:
                    donor, shared = other, common
        if donor is None:
            return None
        try:
            slot.session.copy_prefix(donor.session, shared)
        except clib.KraflaError as e:
            if e.status != header.KR_ERR_UNSUPPORTED:
                raise
            self.prefix_copies = False
            return None
        slot.cached[:] = donor.cached[:shared]
        return shared

    def release_slot(self, slot):
        if slot.cached_logits is not None:
            # Often a row of a step's buffer (Scheduler): copied, so that the slot keeps its own row
            # and not the whole step's buffer.
            slot.cached_logits = copy_logits(slot.cached_logits)
        self._uses += 1
        slot.last_used = self._uses
        slot.busy = False

    def reset(self):
        """Forget every slot's KV cache (the next prompts are evaluated from scratch)."""
        for slot in self.slots:
            slot.reset()

    def close(self):
        for slot in self.slots:
            slot.session.close()
        if self.speculation is not None:
            self.speculation.close()
        self.model.close()
        close_tokenizer = getattr(self.tokenizer, "close", None)
        if close_tokenizer:
            close_tokenizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# Prompt: what a request asks for, as the generator takes it


@dataclass(frozen=True)
class Prompt:
    tokens: tuple               # the prompt's token ids
    stop_strings: tuple         # the reply ends before the first of these


# Fill-in-the-middle: the spellings of the prefix, suffix and middle tokens in the vocabularies that
# have them, each prompt in prefix-suffix-middle order: Qwen2.5-Coder, Qwen3-Coder and CodeGemma, then
# StarCoder, StarCoder2 and Granite Code.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


class NoFillInTheMiddle(ValueError):
    """The model's vocabulary has no fill-in-the-middle tokens."""


def fim_token_ids(tokenizer):
    """(prefix, suffix, middle) token ids of the tokenizer's fill-in-the-middle format, or None."""
    for spellings in FIM_TOKENS:
        ids = tuple(tokenizer.token_id(spelling) for spelling in spellings)
        if None not in ids:
            return ids
    return None


def build_prompt(runtime, *, messages=None, text=None, tokens=None, infill=None, stop=(), tools=None):
    """The one place a request becomes its prompt tokens and stop strings, for `krafla run` and the
    server alike. Exactly one of: `messages`, a chat rendered turn by turn by the runtime's template
    (with its system prompt for chats that have none, and `tools`, OpenAI's tool definitions, in the
    template's own way), whose stop strings join `stop`; `text`, a raw prompt, encoded with BOS as
    the tokenizer says and the special tokens it spells (`<|im_start|>`, `<|fim_prefix|>`) as those
    tokens, as llama-server's completions and Ollama's raw mode read a prompt (a client that renders
    its own template or fill-in-the-middle prompt spells them; a chat's texts are never read so);
    `tokens`, the ids as given; `infill`, a
    (prefix, suffix) pair of code whose middle the reply is: BOS as the tokenizer says, then the
    vocabulary's fill-in-the-middle tokens around the two texts (FIM_TOKENS), encoded as plain text.
    The reply ends at one of the tokenizer's end-of-text tokens, as every reply does.

    Raises templates.ChatError when the template refuses the chat (or there is no template), ValueError
    when the text encodes to no tokens, NoFillInTheMiddle for an infill the vocabulary cannot spell.
    """
    if sum(x is not None for x in (messages, text, tokens, infill)) != 1:
        raise TypeError("build_prompt takes exactly one of messages, text, tokens and infill")
    if tools and messages is None:
        raise TypeError("build_prompt takes tools only with messages")
    stop = tuple(stop)
    if messages is not None:
        if runtime.template is None:
            raise templates.ChatError("this model has no chat template: give --chat TEMPLATE, or send plain text")
        ids = runtime.template.render(list(messages), runtime.tokenizer, system=runtime.system, tools=tools or None)
        return Prompt(tuple(ids), stop + tuple(runtime.template.stop_strings))
    if tokens is not None:
        return Prompt(tuple(int(t) for t in tokens), stop)
    if infill is not None:
        tokenizer = runtime.tokenizer
        fim = fim_token_ids(tokenizer)
        if fim is None:
            raise NoFillInTheMiddle("this model's vocabulary has no fill-in-the-middle tokens "
                                    f"({', '.join(spellings[0] for spellings in FIM_TOKENS)}, ...)")
        prefix, suffix = (tokenizer.encode(part, add_bos=False, add_eos=False) for part in infill)
        bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
        return Prompt(tuple(bos + [fim[0], *prefix, fim[1], *suffix, fim[2]]), stop)
    ids = runtime.tokenizer.encode(text, special=True)
    if not ids:
        raise ValueError("the prompt is empty: it encodes to no tokens")
    return Prompt(tuple(ids), stop)


# ---------------------------------------------------------------------------------------------
# Generation: one request's reply, step by step

# With prompt_logprobs every prompt position's logits are kept for a step (a row of n_vocab floats
# each): at most this many prompt tokens per step bounds that to a few tens of MB.
PROMPT_LOGPROBS_CHUNK = 64


class Generation:
    """One request's reply as a state machine, so one driver can run it alone (Generator.generate)
    and the scheduler (krafla_twisted/generation/scheduler.py) can run many side by side in the same forward
    steps. The arguments are Generator.generate's; the constructor checks them.

        generation.attach(slot)                 # prefix reuse in a free Slot
        while not generation.done:
            tokens, mode = generation.next_input(budget)   # mode "none" (more prompt follows) or "last"
            generation.feed(logits)             # after evaluating tokens in generation.slot.session
        generation.result                       # a GenerationResult

    Every sampling, stop and emit rule lives here once: the engine gives a sequence's logits
    bitwise whatever else shares its step and however its prompt was chunked, so the reply is the
    same bytes however it is driven.
    """

    def __init__(self, runtime, prompt_tokens, *, max_tokens=None, sampling=None, stop_strings=(), on_text=None,
                 cancelled=lambda: False, on_prompt_progress=None, constraint=None, logit_bias=None,
                 logprobs=None, on_logprobs=None, prompt_logprobs=None, reply=True):
        self.runtime = runtime
        prompt = [int(t) for t in prompt_tokens]
        sampling = (sampling or runtime.sampling).check()
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        n_vocab = runtime.model.n_vocab
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
        n_ctx = runtime.n_ctx
        if len(prompt) >= n_ctx:
            raise ContextLengthExceeded(len(prompt), n_ctx)
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, not {max_tokens}")
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(64)
        self.sampling = dataclasses.replace(sampling, seed=seed)
        self.prompt = prompt
        self.limit = n_ctx - len(prompt) if not max_tokens else min(n_ctx - len(prompt), max_tokens)
        if not reply:
            self.limit = 0          # the prompt alone: its logprobs, no reply
        self.stop_strings = stop_strings
        self.on_text = on_text
        self.cancelled = cancelled
        self.on_prompt_progress = on_prompt_progress
        self.constraint = constraint
        self.logit_bias = logit_bias
        self.logprobs = logprobs
        self.on_logprobs = on_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.prompt_entries = []    # TokenLogprobs of prompt tokens 1.. when prompt_logprobs is set
        self.history_size = self.sampling.repeat_last_n if self.sampling.repeat_last_n >= 0 else n_ctx
        self.slot = None
        self.position = 0           # prompt tokens in the slot's cache
        self.cached_count = 0
        self.pending = ()           # the tokens handed out by next_input, not yet fed back
        self.sampler = None
        self.reply = []
        self.pieces = []
        self.token_logprobs = []
        self.reported = 0           # token_logprobs already given to on_logprobs
        self.decoder = self.stops = None  # made, with the sampler, once the prompt is in
        self.result = None
        self.error = None           # set by a driver when evaluating this generation failed
        self.skipped = False        # set by the scheduler when it was cancelled while every slot was busy
        self.started = time.perf_counter()
        self.prompt_seconds = 0.0
        self.proposer = None        # speculate.*Proposer, made with the sampler when the runtime speculates
        self.proposed = self.accepted = 0

    @property
    def done(self):
        return self.result is not None

    @property
    def prefilling(self):
        return self.sampler is None

    def attach(self, slot):
        """Bring `slot` to the longest prefix of the prompt it holds, or to a longer one copied from
        another slot (Runtime.seed_slot); the last prompt token always runs again for its logits,
        unless they are cached. Must be called in the thread that owns the runtime. Qwen3.5's
        linear attention cannot be cut back: a slot that would need it starts over."""
        self.slot = slot
        self.started = time.perf_counter()
        prompt = self.prompt
        common = slot.common_prefix(prompt)
        if self.prompt_logprobs is not None:
            common = 0  # every position runs again: its logits score the prompt token after it
        elif common == len(prompt) == len(slot.cached) and slot.cached_logits is not None:
            self.position = self.cached_count = common
            self._prompt_done()
            self._next_token(slot.cached_logits)
            return
        if common == len(prompt):
            common -= 1  # the last prompt token runs again to give its logits
        seeded = self.runtime.seed_slot(slot, prompt, common) if self.prompt_logprobs is None else None
        if seeded is not None:
            common = seeded
        elif common < slot.session.n_tokens:
            try:
                slot.session.truncate(common)
            except clib.KraflaError:
                slot.reset()
                common = 0
        del slot.cached[common:]
        slot.cached_logits = None
        self.position = self.cached_count = common

    def next_input(self, budget):
        """(token ids, logits mode) to evaluate next in self.slot.session: up to `budget` prompt
        tokens ("none" while more of the prompt follows, "last" for its end), or the last reply
        token ("last"), followed, when the runtime speculates, by up to budget - 1 proposed tokens
        ("all": every position's logits are needed to check them). With prompt_logprobs, prompt
        chunks of at most PROMPT_LOGPROBS_CHUNK tokens ask for every position's logits too ("all").
        The ids are empty when budget is 0 during the prompt. None once the generation is over.
        Cancellation is noticed before each prompt chunk and before each token is sampled."""
        if self.result is not None:
            return None
        if self.prefilling:
            if self.cancelled():
                self._end("cancelled")
                return None
            scoring = self.prompt_logprobs is not None
            if scoring:
                budget = min(budget, PROMPT_LOGPROBS_CHUNK)
            chunk = self.prompt[self.position:self.position + max(0, budget)]
            self.pending = chunk
            if scoring:
                return chunk, ("all" if len(chunk) > 1 else "last")  # a lone token's row is its last
            return chunk, ("last" if self.position + len(chunk) == len(self.prompt) else "none")
        proposal = self._proposal(budget - 1)
        self.pending = [self.reply[-1]] + proposal
        return self.pending, ("all" if proposal else "last")

    def _proposal(self, most):
        """The proposer's guess of the next tokens, at most `most`, and never more than can still
        be kept (the rows past max_tokens would be wasted). It ends before a stop token (nothing after
        one is needed) and, with a grammar, before the first token the grammar refuses."""
        most = min(most, self.limit - len(self.reply) - 1)
        if self.proposer is None or most <= 0:
            return []
        proposal = self.proposer.propose(self.reply, most)[:most]
        stops = self.runtime.stop_token_ids
        for index, token in enumerate(proposal):
            if token in stops:
                del proposal[index:]
                break
        if proposal and self.constraint is not None:
            allowed = getattr(self.constraint, "allowed_prefix", None)
            if allowed is not None:
                del proposal[allowed(proposal):]
        return proposal

    def feed(self, logits):
        """The session evaluated what next_input gave; `logits` are the last token's (None for "none"),
        or the rows of every position when it gave proposed tokens or asked for the prompt's
        logprobs ("all")."""
        if len(self.pending) > 1 and not self.prefilling:
            return self._verify(logits)
        if self.prefilling and self.prompt_logprobs is not None:
            logits = self._score_prompt(logits)
        slot = self.slot
        slot.cached.extend(self.pending)
        slot.cached_logits = logits
        if self.prefilling:
            self.position += len(self.pending)
            if self.on_prompt_progress:
                self.on_prompt_progress(self.position, len(self.prompt))
            if self.position < len(self.prompt):
                return
            self._prompt_done()
            if self.limit == 0:
                return self._end("length")
        self._next_token(logits)

    def _score_prompt(self, rows):
        """Record, from the rows of a prompt chunk, each next prompt token's TokenLogprob; returns the
        last row (the logits after the chunk)."""
        prompt = self.prompt
        if not isinstance(rows, list):
            rows = [rows]
        for index, row in enumerate(rows):
            after = self.position + index + 1
            if after < len(prompt):
                self.prompt_entries.append(token_logprob(row, prompt[after], self.prompt_logprobs))
        return rows[-1]

    def _verify(self, rows):
        """Sample position by position from `rows` (row j after pending[j]) exactly as without
        speculation, while the sampled token is the proposed one; keep the first one that differs
        (or the one after the whole proposal), and cut the KV cache back past the proposed tokens not
        taken. speculate.py's docstring says why this changes neither a token nor a logit."""
        slot = self.slot
        proposal = self.pending[1:]
        base = len(slot.cached)
        accepted = 0
        try:
            for index, row in enumerate(rows):
                slot.cached.append(self.pending[index])  # the history the sampler sees: prompt and reply so far
                before = len(self.reply)
                self._next_token(row)
                took = index < len(proposal) and len(self.reply) > before and self.reply[-1] == proposal[index]
                if took:
                    accepted += 1
                if not took or self.result is not None:
                    break
        finally:  # even when sampling failed (a grammar error): the slot's cache must say what its session holds
            keep = base + 1 + accepted
            del slot.cached[keep:]
            slot.cached_logits = rows[accepted]
            if slot.session.n_tokens > keep:
                slot.session.truncate(keep)
        self.proposed += len(proposal)
        self.accepted += accepted
        if self.result is not None:
            self.result = dataclasses.replace(self.result, proposed_tokens=self.proposed,
                                              accepted_tokens=self.accepted)
        elif self.proposer is not None:
            self.proposer.observe(len(proposal), accepted)

    def cancel(self):
        """End now as cancelled (a driver noticed it before the generation got a slot)."""
        if self.result is None:
            self._end("cancelled")

    def fail(self, error):
        """Evaluating this generation failed: it is over, `error` is what its caller gets."""
        self.error = error
        self._close_sampler()
        self.result = GenerationResult("", "cancelled", len(self.prompt), len(self.reply), self.cached_count,
                                       self.prompt_seconds, 0.0, tuple(self.reply), self.sampling.seed)

    def _prompt_done(self):
        self.prompt_seconds = time.perf_counter() - self.started
        self.started = time.perf_counter()
        # gpt-oss's replies are read by their control tokens (<|channel|>, <|message|>, ...): its
        # template asks for them in the text
        control = getattr(getattr(self.runtime, "template", None), "reply_control_tokens", False)
        self.decoder = self.runtime.tokenizer.streaming_decoder(special=control)
        self.stops = StopStringFilter(self.stop_strings)
        self.sampler = Sampler(self.sampling, self.runtime.model.n_vocab)
        if self.runtime.speculation is not None:
            self.proposer = self.runtime.speculation.proposer(self.runtime, self.slot, self.prompt)

    def _next_token(self, logits):
        """Sample after `logits`, emit the text that is final, and end the reply when a rule says so."""
        if self.cancelled():
            return self._end("cancelled")
        sampling = self.sampling
        constraint = self.constraint
        history = ()
        if self.history_size and sampling.penalises:
            history = self.slot.cached[-self.history_size:]
        chosen_from = logits
        if self.logit_bias:
            chosen_from = apply_logit_bias(logits, self.logit_bias)
        if constraint is not None:
            chosen_from = constraint.mask(chosen_from if chosen_from is not logits else copy_logits(logits))
        token = self.sampler.sample(chosen_from, history)
        if token in self.runtime.stop_token_ids:
            return self._end("stop")
        if self.logprobs is not None:
            self.token_logprobs.append(token_logprob(logits, token, self.logprobs))
        self.reply.append(token)
        if constraint is not None:
            constraint.accept(token)
        text, stopped = self.stops.push(self.decoder.push(token))
        self._emit(text)
        if stopped or (constraint is not None and constraint.done):
            return self._end("stop")
        if len(self.reply) >= self.limit:
            return self._end("length")

    def _emit(self, text):
        if text:
            self.pieces.append(text)
            self._report_logprobs()
            if self.on_text is not None:
                self.on_text(text)

    def _report_logprobs(self):
        if self.on_logprobs is not None and len(self.token_logprobs) > self.reported:
            self.on_logprobs(tuple(self.token_logprobs[self.reported:]))
            self.reported = len(self.token_logprobs)

    def _end(self, finish):
        if self.prefilling:  # cancelled before the prompt was in
            self.prompt_seconds = time.perf_counter() - self.started
            self.result = GenerationResult("", finish, len(self.prompt), 0, self.cached_count, self.prompt_seconds,
                                           0.0, (), self.sampling.seed)
            return
        if not self.stops.stopped:
            text, stopped = self.stops.push(self.decoder.flush())
            self._emit(text)
            if not stopped:
                text, stopped = self.stops.finish()
                self._emit(text)
            if stopped:
                finish = "stop"  # the held-back end of the reply held a stop string
        self._report_logprobs()
        self._close_sampler()
        self.result = GenerationResult("".join(self.pieces), finish, len(self.prompt), len(self.reply),
                                       self.cached_count, self.prompt_seconds, time.perf_counter() - self.started,
                                       tuple(self.reply), self.sampling.seed, tuple(self.token_logprobs),
                                       self.stops.matched, self.proposed, self.accepted, tuple(self.prompt_entries))

    def _close_sampler(self):
        if self.sampler is not None:
            self.sampler.close()


# ---------------------------------------------------------------------------------------------
# Generator: one generation at a time


class Generator:
    """Generates replies with a Runtime, one at a time; see the module docstring for the rules."""

    def __init__(self, runtime):
        self.runtime = runtime

    def generate(self, prompt_tokens, **options):
        """Generate after `prompt_tokens`. max_tokens None or 0: until the context is full.
        `on_text(piece)` gets the reply's text as it becomes final; `cancelled()` is asked
        between tokens (and between prompt batches); `on_prompt_progress(done, total)` after
        each prompt batch. Must be called in the thread that owns the runtime.

        `constraint` (a grammar.Constraint) masks every step's logits and ends the reply when its
        value is complete; `logit_bias` ({id: bias}) is added first. `logprobs` (None, or how many
        alternatives, 0-20) records a TokenLogprob per reply token; `on_logprobs(entries)` gets
        those of the tokens sampled since the last call, just before each `on_text`.

        The keywords are Generation's: max_tokens, sampling, stop_strings, on_text, cancelled,
        on_prompt_progress, constraint, logit_bias, logprobs, on_logprobs."""
        return run_alone(Generation(self.runtime, prompt_tokens, **options))


def run_alone(generation):
    """Drive `generation` to its end in a free slot of its runtime, one Session.eval per step
    (prompt batches of runtime.batch tokens); returns its GenerationResult. Must be called in the
    thread that owns the runtime."""
    runtime = generation.runtime
    slot = runtime.choose_slot(generation.prompt)
    if slot is None:
        raise RuntimeError("every slot of the runtime is busy")
    try:
        generation.attach(slot)
        while True:
            wanted = generation.next_input(max(1, runtime.batch))
            if wanted is None:
                break
            tokens, mode = wanted
            if mode == "all":
                (out, rows), = logits_blocks([len(tokens)], runtime.model.n_vocab)
                runtime.model.eval_batch([(slot.session, tokens, "all", out)])
                generation.feed(rows)
            else:
                generation.feed(slot.session.eval(tokens, out=logits_blocks([1], runtime.model.n_vocab)[0][0]))
    except BaseException:
        generation._close_sampler()
        raise
    finally:
        runtime.release_slot(slot)
    return generation.result
