"""POST /tokenize and /detokenize, shaped like llama-server's and vLLM's (not part of OpenAI's API),
and vLLM's GET /tokenizer_info.

    POST /tokenize   {"content": "Hello", "add_special": false, "parse_special": true, "with_pieces": false}
                  -> {"tokens": [19556], "count": 1, "max_model_len": 8192}
                     with_pieces: {"tokens": [{"id": 19556, "piece": "Hello"}], ...}
                     vLLM's form: {"prompt": "Hello", "add_special_tokens": true} (BOS by default)
    POST /detokenize {"tokens": [19556]} -> {"content": "Hello", "prompt": "Hello"}
    GET  /tokenizer_info -> {"eos_token": "<|endoftext|>", "bos_token": null, "chat_template": "...", ...}

With these, lm-evaluation-harness's remote tokenizer (tokenizer_backend=remote, or auto) needs no
copy of the model's tokenizer on the client.

A piece that is not whole UTF-8 (one byte of a multi-byte character) is given as a list of byte
values, as llama-server does. The tokenizer belongs to the engine, so the work is a job on the
engine worker like a completion: it waits its turn inside --max-queue, and a request that comes
while the server stops gets 503 instead of a tokenizer that is being closed.
"""

import json

from twisted.web.server import NOT_DONE_YET

from krafla_twisted.api.errors import InvalidRequest
from krafla_twisted.api.resources import Endpoint, QueuedReply
from krafla_twisted.api.schema import parse_json_body


def _flag(body, name, default):
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", param=name)
    return value


def parse_tokenize(body):
    """(content, add_special, parse_special, with_pieces) of a /tokenize body; InvalidRequest when wrong.
    llama-server's form names the text `content` (no BOS unless add_special); vLLM's names it
    `prompt`, with `add_special_tokens` (BOS unless false)."""
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object")
    name = "content" if "content" in body or "prompt" not in body else "prompt"
    content = body.get(name)
    if not isinstance(content, str):
        raise InvalidRequest(f"'{name}' is required and must be a string", param=name)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{name}' holds a lone UTF-16 surrogate", param=name) from None
    if "add_special_tokens" in body:
        add_special = _flag(body, "add_special_tokens", True)
    else:
        add_special = _flag(body, "add_special", name == "prompt")
    return content, add_special, _flag(body, "parse_special", True), _flag(body, "with_pieces", False)


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


class Tokenize(Endpoint):
    methods = ("POST",)

    def render_POST(self, request):
        # I/O thread: parse and check the body here; the tokenizer runs in the worker thread.
        content, add_special, parse_special, with_pieces = parse_tokenize(parse_json_body(request.content.read()))
        self.api.admit()
        def work(backend, cancelled):
            answer = backend.tokenize(content, add_special=add_special, parse_special=parse_special,
                                      with_pieces=with_pieces)
            return dict(answer, count=len(answer["tokens"]), max_model_len=backend.n_ctx)

        QueuedReply(self.api, request, work).start()
        return NOT_DONE_YET


class Detokenize(Endpoint):
    methods = ("POST",)

    def render_POST(self, request):
        tokens = parse_detokenize(parse_json_body(request.content.read()), self.api.backend.n_vocab)
        self.api.admit()
        QueuedReply(self.api, request, lambda backend, cancelled: backend.detokenize(tokens)).start()
        return NOT_DONE_YET


class TokenizerInfo(Endpoint):
    methods = ("GET",)

    def render_GET(self, request):
        self.api.admit()
        QueuedReply(self.api, request, lambda backend, cancelled: backend.tokenizer_info()).start()
        return NOT_DONE_YET
