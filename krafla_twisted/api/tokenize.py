"""POST /tokenize and /detokenize, shaped like llama-server's (not part of OpenAI's API).

    POST /tokenize   {"content": "Hello", "add_special": false, "parse_special": true, "with_pieces": false}
                  -> {"tokens": [19556]}     with_pieces: {"tokens": [{"id": 19556, "piece": "Hello"}]}
    POST /detokenize {"tokens": [19556]} -> {"content": "Hello"}

A piece that is not whole UTF-8 (one byte of a multi-byte character) is given as a list of byte
values, as llama-server does. The tokenizer is safe to share between threads, so the work runs in
the reactor's thread pool, beside (not behind) a generation in progress.
"""

import json

from twisted.internet import threads
from twisted.web.server import NOT_DONE_YET

from krafla_twisted.api.errors import APIError, InvalidRequest, ServerError
from krafla_twisted.api.resources import Endpoint, error_response, json_response, log
from krafla_twisted.api.schema import parse_json_body


def _flag(body, name, default):
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", param=name)
    return value


def parse_tokenize(body):
    """(content, add_special, parse_special, with_pieces) of a /tokenize body; InvalidRequest when wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object")
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidRequest("'content' is required and must be a string", param="content")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest("'content' holds a lone UTF-16 surrogate", param="content") from None
    return content, _flag(body, "add_special", False), _flag(body, "parse_special", True), _flag(body, "with_pieces", False)


def parse_detokenize(body, n_vocab):
    """The token ids of a /detokenize body; InvalidRequest unless each is an id of this vocabulary."""
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequest("'tokens' is required and must be a list of token ids", param="tokens")
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
            raise InvalidRequest(f"'tokens' holds {json.dumps(token)}, not a token id below {n_vocab}", param="tokens")
    return tokens


def piece(tokenizer, token_id):
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


class _Threaded(Endpoint):
    """An endpoint whose answer is computed in the reactor's thread pool."""

    methods = ("POST",)

    def __init__(self, api, reactor, pool=None):
        super().__init__(api)
        self.reactor = reactor
        self.pool = pool  # None: the reactor's thread pool

    def render_POST(self, request):
        # I/O thread: parse and check the body here; the tokenizer runs in the pool.
        body = parse_json_body(request.content.read())
        work = self.parse(body)
        finished = []
        request.notifyFinish().addBoth(finished.append)
        pool = self.pool if self.pool is not None else self.reactor.getThreadPool()
        d = threads.deferToThreadPool(self.reactor, pool, self.compute, work)

        def answer(payload):
            if not finished:
                request.write(json_response(request, payload))
                request.finish()

        def failed(failure):
            if finished:
                return
            error = failure.value
            if not isinstance(error, APIError):
                log.failure("{path} failed", failure, path=request.path.decode("ascii", "replace"))
                error = ServerError("internal server error")
            request.write(error_response(request, error))
            request.finish()

        d.addCallback(answer).addErrback(failed)
        return NOT_DONE_YET


class Tokenize(_Threaded):
    def parse(self, body):
        return parse_tokenize(body)

    def compute(self, work):
        # This runs in a thread of the pool, never in the I/O thread.
        content, add_special, parse_special, with_pieces = work
        tokenizer = self.api.backend.tokenizer
        ids = tokenizer.encode(content, add_bos=None if add_special else False, special=parse_special)
        if with_pieces:
            return {"tokens": [{"id": i, "piece": piece(tokenizer, i)} for i in ids]}
        return {"tokens": ids}


class Detokenize(_Threaded):
    def parse(self, body):
        return parse_detokenize(body, self.api.backend.n_vocab)

    def compute(self, tokens):
        # This runs in a thread of the pool, never in the I/O thread.
        text = self.api.backend.tokenizer.decode(tokens)
        return {"content": text.decode("utf-8", "replace")}
