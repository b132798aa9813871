"""GET /metrics (with --metrics): counters in the Prometheus text format, version 0.0.4.

Every finished request is counted by endpoint and status; completions add their token counts and
the seconds spent on the prompt and on the reply, so tokens/s over any window is a `rate()` of two
counters. The gauges give the average speeds since start, the requests waiting for the engine, and
the KV-cache reuse. A server of several models (--models) labels each sample with its model.
Everything here runs in the I/O thread. The APISite given a Metrics counts
each request when its log line is written; krafla_twisted/api/routes.py serves MetricsResource.
"""

import collections

from krafla_twisted.api.resources import Endpoint

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

# Paths are folded onto these names so a client cannot grow the label set; anything else is "other".
ENDPOINTS = ("chat/completions", "completions", "models", "health", "metrics", "tokenize", "detokenize", "tokenizer_info",
             "responses", "messages", "messages/count_tokens",  # the Responses and Anthropic Messages APIs
             "embeddings", "rerank", "reranking",  # an embedding model's
             "api/chat", "api/generate", "api/tags", "api/show", "api/ps", "api/version", "api/embed",
             "api/embeddings")  # Ollama's


def endpoint_label(path):
    text = path.decode("ascii", "replace") if isinstance(path, bytes) else path
    parts = [p for p in text.split("?")[0].split("/") if p]
    if parts and parts[0] == "v1":
        parts = parts[1:]
    if parts[:1] in (["models"], ["responses"]):   # /models/ID, /responses/ID: one label, not one per id
        return parts[0]
    name = "/".join(parts)
    return name if name in ENDPOINTS else "other"


class Totals:
    """The completion counters of one model."""

    def __init__(self):
        self.completions = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prompt_seconds = 0.0
        self.generation_seconds = 0.0
        self.cache_hits = 0
        self.proposed_tokens = 0   # speculative decoding: tokens proposed, and accepted by the model's sampling
        self.accepted_tokens = 0


class Metrics:
    """The numbers behind /metrics. `pending` is a function giving the jobs queued or running;
    `scheduler` (krafla_twisted.generation.scheduler.Scheduler, or None) gives the slots and the batches.

    A server of several models (--models) gives `engines` instead: a function returning (model name,
    jobs pending, scheduler) for each loaded model; then every sample carries a `model` label (the
    model a request named; requests that named none, such as GET /v1/models, have none)."""

    def __init__(self, pending=lambda: 0, scheduler=None, engines=None):
        self.pending = pending
        self.scheduler = scheduler
        self.engines = engines
        self.requests = collections.Counter()  # (endpoint, status, model) -> count
        self.gone = collections.Counter()  # (endpoint, model) -> requests whose client left before the reply ended
        self.totals = collections.defaultdict(Totals)  # model (None: the one model) -> its counters

    def observe(self, path, status, stats=None, gone=False, model=None):
        """Count one finished request: its path, its status code (None if the client left), its
        GenerationResult, and the model it named (None: the one model)."""
        endpoint = endpoint_label(path)
        if gone:
            self.gone[(endpoint, model)] += 1
        else:
            self.requests[(endpoint, str(status), model)] += 1
        if stats is not None:
            t = self.totals[model]
            t.completions += 1
            t.prompt_tokens += stats.prompt_tokens
            t.cached_tokens += stats.cached_tokens
            t.completion_tokens += stats.completion_tokens
            t.prompt_seconds += stats.prompt_seconds
            t.generation_seconds += stats.generation_seconds
            if stats.cached_tokens > 0:
                t.cache_hits += 1
            t.proposed_tokens += stats.proposed_tokens
            t.accepted_tokens += stats.accepted_tokens

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

        def model_label(model):
            return (("model", model),) if model is not None else ()

        def order(key):
            return tuple("" if part is None else part for part in key)

        if self.engines is None:
            self.totals[None]  # the one model's counters exist (as zeros) from the start
        totals = sorted(self.totals.items(), key=lambda item: item[0] or "")

        def per_model(field):
            return [(model_label(m), field(t)) for m, t in totals]

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [((("endpoint", e), ("status", s), *model_label(m)), n)
                for (e, s, m), n in sorted(self.requests.items(), key=lambda item: order(item[0]))])
        metric("requests_client_gone_total", "counter", "Requests whose client left before the reply was complete.",
               [((("endpoint", e), *model_label(m)), n)
                for (e, m), n in sorted(self.gone.items(), key=lambda item: order(item[0]))])
        metric("completions_total", "counter", "Completions the engine ran (finished, stopped or cancelled).",
               per_model(lambda t: t.completions))
        metric("prompt_tokens_total", "counter", "Prompt tokens of completions, cached ones included.",
               per_model(lambda t: t.prompt_tokens))
        metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the KV cache.",
               per_model(lambda t: t.cached_tokens))
        metric("completion_tokens_total", "counter", "Tokens generated.", per_model(lambda t: t.completion_tokens))
        metric("prompt_seconds_total", "counter", "Seconds spent evaluating prompts.",
               per_model(lambda t: t.prompt_seconds))
        metric("generation_seconds_total", "counter", "Seconds spent generating replies.",
               per_model(lambda t: t.generation_seconds))
        metric("cache_hits_total", "counter", "Completions that reused at least one cached prompt token.",
               per_model(lambda t: t.cache_hits))
        metric("speculative_proposed_tokens_total", "counter",
               "Reply tokens speculative decoding proposed (--spec lookup, --draft) for one step to check.",
               per_model(lambda t: t.proposed_tokens))
        metric("speculative_accepted_tokens_total", "counter",
               "Proposed tokens the model's own sampling confirmed (the rest cost a row each).",
               per_model(lambda t: t.accepted_tokens))
        metric("prompt_tokens_per_second", "gauge", "Prompt tokens evaluated per second, on average since start.",
               per_model(lambda t: (t.prompt_tokens - t.cached_tokens) / t.prompt_seconds
                         if t.prompt_seconds > 0 else 0.0))
        metric("generation_tokens_per_second", "gauge", "Tokens generated per second, on average since start.",
               per_model(lambda t: t.completion_tokens / t.generation_seconds if t.generation_seconds > 0 else 0.0))
        engines = self.engines() if self.engines is not None else [(None, self.pending(), self.scheduler)]
        busy = {m: (scheduler.slots_busy if scheduler is not None else min(pending, 1))
                for m, pending, scheduler in engines}
        metric("requests_pending", "gauge", "Requests queued or running on the engine (completions, /tokenize, "
               "/detokenize).", [(model_label(m), pending) for m, pending, _ in engines])
        metric("requests_queued", "gauge", "Requests waiting for a slot or for the worker thread.",
               [(model_label(m), max(pending - busy[m], 0)) for m, pending, _ in engines])
        if self.engines is not None:
            metric("models_loaded", "gauge", "Models loaded now (--models).", [((), len(engines))])
        batches = [(model_label(m), scheduler) for m, _, scheduler in engines if scheduler is not None]
        if batches:
            self._render_batches(metric, batches)
        return ("\n".join(out) + "\n").encode("utf-8")

    @staticmethod
    def _render_batches(metric, batches):
        """Slots and forward steps of each (labels, scheduler), read from the worker threads' plain
        counters (no lock: a scrape may see one step's counters half updated, never a wrong type)."""
        def each(field):
            return [(labels, field(scheduler)) for labels, scheduler in batches]

        metric("slots", "gauge", "Slots (--parallel): replies that can be generated side by side.",
               each(lambda s: s.parallel))
        metric("slots_busy", "gauge", "Slots holding a reply being generated.", each(lambda s: s.slots_busy))
        metric("batch_steps_total", "counter", "Forward steps run over the active replies.", each(lambda s: s.steps))
        metric("batch_tokens_total", "counter", "Tokens evaluated in those steps (prompt chunks and reply tokens).",
               each(lambda s: s.batch_tokens_total))
        metric("batch_sequences_last", "gauge", "Sequences in the last forward step.",
               each(lambda s: s.last_batch_sequences))
        samples = []
        for labels, scheduler in batches:
            histogram = list(scheduler.batch_histogram)
            running = 0
            for size, count in enumerate(histogram[1:], start=1):
                running += count
                samples.append(("_bucket", (*labels, ("le", str(size))), running))
            samples += [("_bucket", (*labels, ("le", "+Inf")), running),
                        ("_sum", labels, scheduler.batch_sequences_total), ("_count", labels, running)]
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
