"""Stand-ins for a tokenizer and a constraint, for generation tests on tiny random models.

LetterTokenizer spells token i as the letter "a" + i % 26 (one byte) and has no stop tokens, so a
reply runs to its limit; RecordingConstraint masks nothing and keeps a copy of the logits of every
token the generation samples (the row is the step's buffer, so it is copied).
"""

import numpy as np


class LetterTokenizer:
    def __init__(self, n_vocab):
        self.n_vocab = n_vocab
        self.eot_ids = frozenset()
        self.eos_id = None

    def streaming_decoder(self, special=False):
        return LetterDecoder()  # (no control tokens: `special` changes nothing)


class LetterDecoder:
    def push(self, token):
        return chr(ord("a") + token % 26)

    def flush(self):
        return ""


class RecordingConstraint:
    def __init__(self):
        self.logits = []
        self.done = False

    def mask(self, logits):
        self.logits.append(np.array(logits, dtype=np.float32))
        return logits

    def accept(self, token):
        pass
