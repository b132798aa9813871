"""GET /metrics (with --metrics): counters in the Prometheus text format, version 0.0.4.

Every finished request is counted by endpoint and status; completions add their token counts and
the seconds spent on the prompt and on the reply, so tokens/s over any window is a `rate()` of two
counters. The gauges give the average speeds since start, the requests waiting for the engine, and
the KV-cache reuse. Everything here runs in the I/O thread. The APISite given a Metrics counts
each request when its log line is written; krafla_twisted/api/routes.py serves MetricsResource.
"""

import collections

from krafla_twisted.api.resources import Endpoint

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# Paths are folded onto these names so a client cannot grow the label set; anything else is "other".
ENDPOINTS = ("chat/completions", "completions", "models", "health", "metrics", "tokenize", "detokenize",
             "responses", "messages", "messages/count_tokens",  # the Responses and Anthropic Messages APIs
             "api/chat", "api/generate", "api/tags", "api/show", "api/ps", "api/version")  # Ollama's


def endpoint_label(path):
    text = path.decode("ascii", "replace") if isinstance(path, bytes) else path
    parts = [p for p in text.split("?")[0].split("/") if p]
    if parts and parts[0] == "v1":
        parts = parts[1:]
    if parts[:1] in (["models"], ["responses"]):   # /models/ID, /responses/ID: one label, not one per id
        return parts[0]
    name = "/".join(parts)
    return name if name in ENDPOINTS else "other"


class Metrics:
    """The numbers behind /metrics. `pending` is a function giving the jobs queued or running;
    `scheduler` (krafla_twisted.generation.scheduler.Scheduler, or None) gives the slots and the batches."""

    def __init__(self, pending=lambda: 0, scheduler=None):
        self.pending = pending
        self.scheduler = scheduler
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.gone = collections.Counter()  # endpoint -> requests whose client left before the reply ended
        self.completions = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prompt_seconds = 0.0
        self.generation_seconds = 0.0
        self.cache_hits = 0
        self.proposed_tokens = 0   # speculative decoding: tokens proposed, and accepted by the model's sampling
        self.accepted_tokens = 0

    def observe(self, path, status, stats=None, gone=False):
        """Count one finished request: its path, its status code (None if the client left), its GenerationResult."""
        endpoint = endpoint_label(path)
        if gone:
            self.gone[endpoint] += 1
        else:
            self.requests[(endpoint, str(status))] += 1
        if stats is not None:
            self.completions += 1
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.completion_tokens += stats.completion_tokens
            self.prompt_seconds += stats.prompt_seconds
            self.generation_seconds += stats.generation_seconds
            if stats.cached_tokens > 0:
                self.cache_hits += 1
            self.proposed_tokens += stats.proposed_tokens
            self.accepted_tokens += stats.accepted_tokens

    def render(self):
        """The exposition text."""
        out = []

        def metric(name, kind, help_text, samples):
            """samples: (labels, value), or (suffix, labels, value) for a histogram's _bucket, _sum, _count."""
            out.append(f"# HELP krafla_{name} {help_text}")
            out.append(f"# TYPE krafla_{name} {kind}")
            for sample in samples:
                suffix, labels, value = sample if len(sample) == 3 else ("", *sample)
                label_text = ",".join(f'{k}="{v}"' for k, v in labels)
                full = f"krafla_{name}{suffix}"
                out.append(f"{full}{{{label_text}}} {_number(value)}" if labels else f"{full} {_number(value)}")

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [((("endpoint", e), ("status", s)), n) for (e, s), n in sorted(self.requests.items())])
        metric("requests_client_gone_total", "counter", "Requests whose client left before the reply was complete.",
               [((("endpoint", e),), n) for e, n in sorted(self.gone.items())])
        metric("completions_total", "counter", "Completions the engine ran (finished, stopped or cancelled).",
               [((), self.completions)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of completions, cached ones included.",
               [((), self.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the KV cache.", [((), self.cached_tokens)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [((), self.completion_tokens)])
        metric("prompt_seconds_total", "counter", "Seconds spent evaluating prompts.", [((), self.prompt_seconds)])
        metric("generation_seconds_total", "counter", "Seconds spent generating replies.", [((), self.generation_seconds)])
        metric("cache_hits_total", "counter", "Completions that reused at least one cached prompt token.",
               [((), self.cache_hits)])
        metric("speculative_proposed_tokens_total", "counter",
               "Reply tokens speculative decoding proposed (--spec lookup, --draft) for one step to check.",
               [((), self.proposed_tokens)])
        metric("speculative_accepted_tokens_total", "counter",
               "Proposed tokens the model's own sampling confirmed (the rest cost a row each).",
               [((), self.accepted_tokens)])
        computed = self.prompt_tokens - self.cached_tokens
        metric("prompt_tokens_per_second", "gauge", "Prompt tokens evaluated per second, on average since start.",
               [((), computed / self.prompt_seconds if self.prompt_seconds > 0 else 0.0)])
        metric("generation_tokens_per_second", "gauge", "Tokens generated per second, on average since start.",
               [((), self.completion_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0)])
        pending = self.pending()
        scheduler = self.scheduler
        busy = scheduler.slots_busy if scheduler is not None else min(pending, 1)
        metric("requests_pending", "gauge", "Requests queued or running on the engine (completions, /tokenize, "
               "/detokenize).", [((), pending)])
        metric("requests_queued", "gauge", "Requests waiting for a slot or for the worker thread.",
               [((), max(pending - busy, 0))])
        if scheduler is not None:
            self._render_batches(metric, scheduler)
        return ("\n".join(out) + "\n").encode("utf-8")

    @staticmethod
    def _render_batches(metric, scheduler):
        """Slots and forward steps, read from the worker thread's plain counters (no lock: a scrape
        may see one step's counters half updated, never a wrong type)."""
        metric("slots", "gauge", "Slots (--parallel): replies that can be generated side by side.",
               [((), scheduler.parallel)])
        metric("slots_busy", "gauge", "Slots holding a reply being generated.", [((), scheduler.slots_busy)])
        metric("batch_steps_total", "counter", "Forward steps run over the active replies.", [((), scheduler.steps)])
        metric("batch_tokens_total", "counter", "Tokens evaluated in those steps (prompt chunks and reply tokens).",
               [((), scheduler.batch_tokens_total)])
        metric("batch_sequences_last", "gauge", "Sequences in the last forward step.",
               [((), scheduler.last_batch_sequences)])
        histogram = list(scheduler.batch_histogram)
        samples, running = [], 0
        for size, count in enumerate(histogram[1:], start=1):
            running += count
            samples.append(("_bucket", (("le", str(size)),), running))
        samples += [("_bucket", (("le", "+Inf"),), running), ("_sum", (), scheduler.batch_sequences_total),
                    ("_count", (), running)]
        metric("batch_sequences", "histogram", "Sequences per forward step.", samples)


def _number(value):
    if isinstance(value, float):
        return repr(value)
    return str(value)


class MetricsResource(Endpoint):
    """GET /metrics. Behind the API key like every endpoint but /health (Prometheus sends it as bearer_token)."""

    methods = ("GET",)

    def __init__(self, api, metrics):
        super().__init__(api)
        self.metrics = metrics

    def render_GET(self, request):
        request.setHeader(b"content-type", CONTENT_TYPE)
        return self.metrics.render()
