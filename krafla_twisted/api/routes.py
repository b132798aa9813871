"""The route table: every endpoint of the server, in one place.

    /v1/chat/completions  /v1/completions  /v1/models[/ID]  /health
    /v1/tokenize  /v1/detokenize  /v1/tokenizer_info  /v1/metrics (with --metrics)
    /v1/messages  /v1/messages/count_tokens (Anthropic's Messages API)
    /v1/responses  /v1/responses/{id} (OpenAI's Responses API, api/responses.py)
    /v1/embeddings  /v1/rerank  /v1/reranking (api/embeddings.py; a server started with --embeddings)

and the same paths without /v1; Ollama's API under /api only (api/ollama.py: /api/chat, /api/generate,
/api/tags, ...). The chat page at / and its files at /ui/ (api/page.py). Everything else is a 404 in the API's shape.
"""

from krafla_twisted.api.anthropic import CountTokens, Messages
from krafla_twisted.api.embeddings import Embeddings, EmbeddingsOnly, Rerank
from krafla_twisted.api.metrics import MetricsResource
from krafla_twisted.api.ollama import build_ollama
from krafla_twisted.api.page import add_chat_page
from krafla_twisted.api.resources import Completions, Group, Health, Models
from krafla_twisted.api.responses import Responses, ResponseStore
from krafla_twisted.api.tokenize import Detokenize, TokenizerInfo, Tokenize


def build_root(api, metrics=None, stored_responses=None):
    """The Resource tree for `api`; /metrics is served when `metrics` (a metrics.Metrics) is given.
    `stored_responses`: the Responses API's store, when several trees share one (api/models.py)."""
    if stored_responses is None:
        stored_responses = ResponseStore()  # one store for /responses and /v1/responses
    routes = {
        (b"chat", b"completions"): lambda: Completions(api, "chat"),
        (b"completions",): lambda: Completions(api, "text"),
        (b"models",): lambda: Models(api),
        (b"health",): lambda: Health(api),
        (b"tokenize",): lambda: Tokenize(api),
        (b"detokenize",): lambda: Detokenize(api),
        (b"tokenizer_info",): lambda: TokenizerInfo(api),   # vLLM's
        # Anthropic's Messages API (count_tokens is a child of messages: listed after it).
        (b"messages",): lambda: Messages(api),
        (b"messages", b"count_tokens"): lambda: CountTokens(api),
        (b"responses",): lambda: Responses(api, stored_responses),  # OpenAI's Responses API
        (b"embeddings",): lambda: Embeddings(api),
        (b"rerank",): lambda: Rerank(api),
        (b"reranking",): lambda: Rerank(api),
    }
    if getattr(api.backend, "embeddings", None) is not None:  # --embeddings: no text generation
        for path in ((b"chat", b"completions"), (b"completions",), (b"tokenize",), (b"detokenize",),
                     (b"tokenizer_info",), (b"messages",),
                     (b"messages", b"count_tokens"), (b"responses",)):
            routes[path] = lambda: EmbeddingsOnly(api)
    if metrics is not None:
        routes[(b"metrics",)] = lambda: MetricsResource(api, metrics)

    root = Group(api)
    root.putChild(b"v1", Group(api))
    for base in (root, root.children[b"v1"]):
        for path, make in routes.items():
            node = base
            for segment in path[:-1]:
                if segment not in node.children:
                    node.putChild(segment, Group(api))
                node = node.children[segment]
            node.putChild(path[-1], make())
    root.putChild(b"api", build_ollama(api))  # Ollama's API: at /api, not under /v1
    add_chat_page(root, api)  # the browser's chat page at /, its files at /ui/ (no key needed to load them)
    return root
