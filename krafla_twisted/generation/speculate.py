"""Speculative decoding: guess several reply tokens, check them all in one forward step.

A generation that speculates hands the engine, instead of its last reply token alone, that token
followed by a proposal of k more, and asks for the logits of every position ("all"). Row j of those
logits is, bit for bit, what the engine gives when the j-th of those tokens is evaluated alone
(the forward pass is batch-invariant: docs/architecture.md). The generation then samples position
by position exactly as it would without speculation; as long as the token it samples is the one
proposed, the next row is already there. At the first difference the sampled token is kept (it is
the reply's next token whatever was proposed) and the KV cache is cut back past the proposed tokens
that were not taken (Session.truncate). So a greedy reply, its logits and its logprobs are the same
with and without speculation, and so is a sampled one with the same seed: the sampler makes one
draw per reply token in both cases, over the same rows.

This is the standard rejection scheme of speculative sampling with a proposal that puts all its
mass on one token (both proposers here propose deterministically): accept the proposed token x with
probability min(1, p(x) / q(x)) = p(x), and on rejection sample from the residual max(0, p - q),
which is p without x, renormalised. Drawing one token from p with the sampler's own random number
and accepting when it is x realises exactly that: x comes out with probability p(x), and any other
token y with probability p(y), so the distribution of the reply is unchanged.

Two proposers:
- `LookupProposer` (--spec lookup): prompt lookup. The continuation of the most recent earlier
  occurrence of the sequence's last n tokens (n from MAX_NGRAM down to MIN_NGRAM) in the prompt and reply.
  It costs a few dictionary operations per token; it wins when the reply copies the prompt (code
  editing, quoting, agent loops that restate a file).
- `DraftProposer` (--draft FILE): a smaller model with the same tokenizer proposes its greedy
  continuation, one token at a time in its own session per slot.

The draft length k adapts to what is accepted (`DraftLength`). Nothing here depends on timing, and
k changes only which rows are computed in a step, never a row's bits: the reply is the same
whatever k is.

Everything here runs in the thread that owns the runtime.
"""

from dataclasses import dataclass

from krafla_twisted.engine.sampler import Sampler

SPEC_MODES = ("lookup", "none")
# --spec's default: see docs/performance.md ("Speculative decoding") for the measurement behind it.
DEFAULT_SPEC = "lookup"

# The n-grams the lookup matches: the longest first, down to MIN_NGRAM. A single token's last
# occurrence predicts little (bench/spec.py's chat task: 13 of 96 such proposals accepted, against
# 242 of 321 after a match of three), and every rejected row costs.
MAX_NGRAM, MIN_NGRAM = 3, 2
# Proposal lengths the adaptation moves between.
MIN_DRAFT, START_DRAFT, MAX_DRAFT = 1, 4, 16

# Architectures whose sessions cannot be cut back to any position (Qwen3.5's recurrent state exists
# only for the last one): speculation would have no way to forget the rejected tokens.
UNTRUNCATABLE_ARCHS = frozenset({"qwen35"})


class DraftError(ValueError):
    """The draft model cannot serve the target: another vocabulary, or it cannot be loaded."""


@dataclass
class Speculation:
    """A runtime's speculation: `mode` "lookup" or "draft"; `draft` the DraftModel for "draft"."""

    mode: str
    draft: object = None
    max_draft: int = MAX_DRAFT

    def proposer(self, runtime, slot, prompt):
        """The proposer for one generation in `slot`, or None when the model cannot speculate."""
        if runtime.model.arch in UNTRUNCATABLE_ARCHS:
            return None
        if self.mode == "draft":
            return DraftProposer(self.draft, slot.index, prompt, self.max_draft)
        return LookupProposer(prompt, self.max_draft)

    def close(self):
        if self.draft is not None:
            self.draft.close()


class DraftLength:
    """How many tokens to propose next, from how the last proposals fared.

    All accepted: the proposals are good, try twice as many. Some rejected: propose one more than
    were accepted (the length that would just have failed). Several rejections in a row with
    nothing accepted: stop proposing for a while (a back-off that doubles), so that a reply that
    copies nothing pays for no wasted rows."""

    def __init__(self, start=START_DRAFT, most=MAX_DRAFT):
        self.most = max(MIN_DRAFT, most)
        self.length = min(start, self.most)
        self.misses = 0        # verifications in a row that accepted nothing
        self.pause = 0         # steps left without proposing
        self.backoff = 1

    def wanted(self):
        """Tokens to propose in this step (0: do not propose)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.length

    def observe(self, proposed, accepted):
        if accepted == proposed:
            self.length = min(2 * self.length, self.most)
            self.misses = 0
            self.backoff = 1
            return
        self.length = max(MIN_DRAFT, min(accepted + 1, self.most))
        if accepted:
            self.misses = 0
            self.backoff = 1
            return
        self.misses += 1
        if self.misses >= 2:
            self.pause = self.backoff
            self.backoff = min(2 * self.backoff, 64)
            self.misses = 0


class LookupProposer:
    """Prompt lookup over the growing sequence (prompt, then reply).

    index[n - 1] maps every n-gram (n <= max_ngram) that has a token after it to where that token
    is, for its most recent occurrence: one dictionary update per n per appended token. Matches of
    fewer than min_ngram tokens are not used."""

    def __init__(self, prompt, max_draft=MAX_DRAFT, max_ngram=MAX_NGRAM, min_ngram=MIN_NGRAM):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens = []
        self.index = [dict() for _ in range(max_ngram)]
        self.length = DraftLength(most=max_draft)
        self._append(prompt)
        self.synced = 0  # reply tokens in self.tokens

    def _append(self, tokens):
        sequence, index = self.tokens, self.index
        for token in tokens:
            end = len(sequence)  # the new token's position: the continuation of the n-grams ending before it
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[n - 1][tuple(sequence[end - n:end])] = end
            sequence.append(token)

    def propose(self, reply, most):
        """Up to `most` tokens that may follow prompt + reply."""
        self._append(reply[self.synced:])
        self.synced = len(reply)
        wanted = min(self.length.wanted(), most)
        if wanted <= 0:
            return []
        sequence = self.tokens
        end = len(sequence)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self.index[n - 1].get(tuple(sequence[end - n:end]))
            if start is not None:
                return sequence[start:start + wanted]
        return []

    def observe(self, proposed, accepted):
        self.length.observe(proposed, accepted)

    def close(self):
        pass


# ---------------------------------------------------------------------------------------------
# Draft model


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab, draft_vocab, draft_path):
    """Raise DraftError unless the draft's tokenizer is the target's: the same number of tokens,
    and every token the same bytes and type."""
    if draft_vocab != target_vocab or draft_tokenizer.n_vocab != target_tokenizer.n_vocab:
        raise DraftError(f"--draft {draft_path}: the draft model has {draft_vocab} tokens but the model "
                         f"{target_vocab}: a draft must use the same tokenizer")
    for token in range(target_vocab):
        if (draft_tokenizer.token_bytes(token) != target_tokenizer.token_bytes(token)
                or draft_tokenizer.token_type(token) != target_tokenizer.token_type(token)):
            raise DraftError(f"--draft {draft_path}: token {token} is {draft_tokenizer.token_bytes(token)!r} in the "
                             f"draft's tokenizer but {target_tokenizer.token_bytes(token)!r} in the model's: a draft "
                             "must use the same tokenizer")


class DraftModel:
    """A draft Model and one Session per slot of the target runtime (each with the tokens in it).
    It owns the model and closes it in close()."""

    def __init__(self, model, parallel, *, ctx, kv="f32", batch=64):
        if model.arch in UNTRUNCATABLE_ARCHS:
            raise DraftError(f"a {model.arch} model cannot be a draft: its sessions cannot be cut back")
        self.model = model
        self.sessions = []
        self.cached = []
        try:
            for _ in range(parallel):
                self.sessions.append(model.session(ctx=ctx, kv=kv, batch=batch))
                self.cached.append([])
        except BaseException:
            model.close()
            raise
        self.greedy = Sampler(_Greedy(), model.n_vocab)

    def close(self):
        self.greedy.close()
        self.model.close()


@dataclass(frozen=True)
class _Greedy:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0


class DraftProposer:
    """The draft model's greedy continuation of prompt + reply, in the draft's session for this slot.

    The draft session keeps what it evaluated between proposals (and between requests, like a
    slot's cache): each proposal cuts it back to its common prefix with the sequence, evaluates the
    rest, then one token at a time."""

    def __init__(self, draft, slot_index, prompt, max_draft=MAX_DRAFT):
        self.draft = draft
        self.session = draft.sessions[slot_index]
        self.cached = draft.cached[slot_index]
        self.prompt = list(prompt)
        self.length = DraftLength(most=max_draft)
        self.row = memoryview(bytearray(4 * draft.model.n_vocab)).cast("f")

    def propose(self, reply, most):
        wanted = min(self.length.wanted(), most)
        if wanted <= 0:
            return []
        sequence = self.prompt + list(reply)
        common = 0
        for held, token in zip(self.cached, sequence):
            if held != token:
                break
            common += 1
        if common == len(sequence):
            common -= 1  # the last token runs again for its logits
        if common < self.session.n_tokens:
            self.session.truncate(common)
        del self.cached[common:]
        proposal = []
        todo = sequence[common:]
        while len(proposal) < wanted:
            if self.session.n_tokens + len(todo) >= self.session.n_ctx:
                break
            self.session.eval(todo, out=self.row)
            self.cached.extend(todo)
            token = self.draft.greedy.sample(self.row)
            proposal.append(token)
            todo = [token]
        return proposal

    def observe(self, proposed, accepted):
        self.length.observe(proposed, accepted)

    def close(self):
        pass
