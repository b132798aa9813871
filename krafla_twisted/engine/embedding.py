"""kr_session_embed through ctypes: an encoder's pooled hidden states, or a decoder's (the final
norm's output, causal attention: Qwen3-Embedding's last-token pooling) (krafla.h, "Embeddings").

    with Model("all-MiniLM-L6-v2-F16.mlb") as model:
        encoder = Encoder(model)
        rows = encoder.embed([[101, 7592, 102], [101, 2088, 102]], pooling="mean")  # 2 rows of dim floats
        scores = encoder.embed(pair_ids, pooling="rank", token_types=pair_types)     # n_labels floats each
        # a decoder: the logits of token ids `pick` after each sequence (a decoder reranker's yes/no)
        rows = Encoder(decoder).last_logits([prompt_one, prompt_two], pick=[no_id, yes_id])

An encoder's session is as long as the model's positions and its step as wide, so any sequence the
model can take fits; a decoder's is KR_DEFAULT_MAX_CTX long at most; several sequences share a forward step and each gets the bits it gets alone.
Results are array.array('f') rows (no numpy: the server runs without it). No normalisation here:
generation/embeddings.py applies what the model card says.
"""

import array
import ctypes

from krafla_twisted.engine import clib, header
from krafla_twisted.engine import model as engine_model

POOLINGS = {name.lower(): code for name, code in header.members("KR_POOLING_").items()}  # kr_pooling
ENCODER_ARCHS = ("bert", "nomic-bert")  # arch_bert.c's: attention both ways, a sequence whole in one step
DECODER_BATCH = 512

_int32_p = ctypes.POINTER(ctypes.c_int32)


@clib.prototypes
def _embedding(lib):
    declare = clib.declare
    # int kr_session_embed(kr_session *session, const int32_t *tokens, const int32_t *token_types,
    #                      const int32_t *lengths, int32_t n_sequences, int32_t pooling, float *out, kr_error *err);
    declare(lib, "kr_session_embed", ctypes.c_int, ctypes.c_void_p, _int32_p, _int32_p, _int32_p, ctypes.c_int32,
            ctypes.c_int32, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(clib.kr_error))
    # int32_t kr_model_pooled_size(const kr_model *model, int32_t pooling);
    declare(lib, "kr_model_pooled_size", ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)


def pooled_size(model, pooling):
    """Floats per sequence kr_session_embed gives `model` for `pooling` (0: it cannot)."""
    return clib.load().kr_model_pooled_size(model.handle, POOLINGS[pooling])


class Encoder:
    """Embeddings of an encoder `Model` (arch bert, nomic-bert): one session of max_seq positions."""

    def __init__(self, model):
        self.model = model
        self.dim = pooled_size(model, "mean")
        self.n_labels = pooled_size(model, "rank")
        self.is_encoder = model.arch in ENCODER_ARCHS
        self._lib = clib.load()
        if self.is_encoder:  # every sequence whole in one step
            self.max_tokens = model.max_seq
            self._session = model.session(ctx=model.max_seq, batch=model.max_seq)
        else:  # a decoder runs one sequence at a time through its KV cache, in steps of DECODER_BATCH
            self.max_tokens = min(model.max_seq, header.KR_DEFAULT_MAX_CTX)
            self._session = model.session(ctx=self.max_tokens, batch=DECODER_BATCH)

    def embed(self, sequences, pooling="mean", token_types=None):
        """One array('f') per sequence of token ids: `dim` floats (mean, cls, last), n_labels
        (rank), or len(sequence) * dim (none). `token_types`: one list per sequence, or None."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        sequences = [list(s) for s in sequences]
        lengths = [len(s) for s in sequences]
        flat = [t for s in sequences for t in s]
        types = None
        if token_types is not None:
            types = clib.int32_array([t for s in token_types for t in s])
            if len(types) != len(flat):
                raise ValueError(f"{len(types)} token types for {len(flat)} tokens")
        width = pooled_size(self.model, pooling)
        sizes = [n * width for n in lengths] if pooling == "none" else [width] * len(lengths)
        out = array.array("f", bytes(4 * sum(sizes)))
        error = clib.kr_error()
        status = self._lib.kr_session_embed(
            self._session.handle, clib.int32_array(flat), types, clib.int32_array(lengths), len(lengths),
            POOLINGS[pooling], clib.float32_array(memoryview(out)), ctypes.byref(error))
        if status:
            engine_model._raise(error)
        rows, at = [], 0
        for size in sizes:
            rows.append(out[at:at + size])
            at += size
        return rows

    def last_logits(self, sequences, pick):
        """A decoder's logits of the token ids `pick` at the last position of each sequence (a
        list of floats per sequence), each sequence evaluated alone from position 0. What a sequence
        shares from its start with the one before (a reranker's prompt up to its document) stays in
        the cache and is not evaluated again: the logits are the same bits either way."""
        if self.is_encoder:
            raise ValueError(f"a {self.model.arch} model is an encoder: it has no logits")
        logits = engine_model.logits_rows(1, self.model.n_vocab)[0]
        session, cached, rows = self._session, [], []
        try:
            session.truncate(0)
            for sequence in sequences:
                sequence = list(sequence)
                keep = 0
                while keep < min(len(cached), len(sequence) - 1) and cached[keep] == sequence[keep]:
                    keep += 1
                session.truncate(keep)
                session.eval(sequence[keep:], out=logits)
                cached = sequence
                rows.append([logits[token] for token in pick])
        finally:
            session.truncate(0)
        return rows

    def close(self):
        self._session.close()
