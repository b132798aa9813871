"""/tokenize, /detokenize and /metrics in memory: the Resource tree over a scripted backend with the
real SmolLM2 tokenizer, driven through StubTreq, with hypothesis generating request bodies.

What these pin: any body gets a 200 in llama-server's shape or a 400 in OpenAI's error shape, never
a 500; token ids and pieces agree with the tokenizer itself; /metrics is valid Prometheus text
(parsed by prometheus_client) whose counters follow the requests made, with paths folded onto a
fixed set of endpoint labels.
"""

import json
import unittest

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from krafla_twisted.api import backend as backend_module
from krafla_twisted.api.metrics import Metrics, endpoint_label
from krafla_twisted.engine.tokenizer import Tokenizer
from tests.support.fake_backend import APIHarness, FakeBackend, FakeResult
from tests.support.real_models import real_model

_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer(str(real_model("smollm2-135m").mlt))
    return _TOKENIZER


class TokenizerBackend(FakeBackend):
    """Scripted completions; /tokenize and /detokenize answered as the real backend answers them, with
    the real tokenizer."""

    def __init__(self):
        super().__init__()
        self.n_vocab = tokenizer().n_vocab

    def tokenize(self, content, **flags):
        return backend_module.tokenize(tokenizer(), content, **flags)

    def detokenize(self, tokens):
        return backend_module.detokenize(tokenizer(), tokens)


def harness(with_metrics=True, api_key=None):
    counters = Metrics() if with_metrics else None
    h = APIHarness(TokenizerBackend(), api_key=api_key, metrics=counters)
    if counters is not None:
        counters.pending = h.worker.pending
    h.metrics = counters
    return h


def samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
TOKENIZE_BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries({"content": JSON | st.text(max_size=40)},
                          optional={"add_special": JSON, "parse_special": JSON, "with_pieces": JSON}),
)
DETOKENIZE_BODIES = st.one_of(
    JSON,
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-5, 50000) | JSON, max_size=8) | JSON}),
)


class TokenizeMemoryTests(unittest.TestCase):
    """The tokenizer endpoints' contract, over the real tokenizer."""

    @classmethod
    def setUpClass(cls):
        cls.h = harness()

    def post(self, path, body):
        response, content = self.h.fetch("POST", path, json.dumps(body))
        return response.code, json.loads(content)

    def test_ids_and_pieces_match_tokenizer(self):
        """Ids are the tokenizer's for the same flags; pieces are its token bytes (as text when whole UTF-8)."""
        tok = tokenizer()
        text = "<|im_start|>user\nHi ✓ 日本"
        code, reply = self.post("/v1/tokenize", {"content": text, "with_pieces": True})
        self.assertEqual(code, 200)
        ids = [p["id"] for p in reply["tokens"]]
        self.assertEqual(ids, tok.encode(text, add_bos=False, special=True))
        for item in reply["tokens"]:
            raw = tok.token_bytes(item["id"])
            self.assertEqual(item["piece"].encode("utf-8") if isinstance(item["piece"], str) else bytes(item["piece"]), raw)
        code, plain = self.post("/tokenize", {"content": text, "parse_special": False})
        self.assertEqual(plain["tokens"], tok.encode(text, add_bos=False, special=False))
        code, with_bos = self.post("/tokenize", {"content": text, "add_special": True})
        self.assertEqual(with_bos["tokens"], tok.encode(text, add_bos=None, special=True))
        code, back = self.post("/detokenize", {"tokens": plain["tokens"]})
        self.assertEqual(back, {"content": text, "prompt": text})

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(TOKENIZE_BODIES)
    @example({"content": "0", "add_special": False, "with_pieces": True})
    def test_any_tokenize_body(self, body):
        """Any JSON body to /tokenize is a 200 with a list of ids (with_pieces: of {"id", "piece"}), or a
        400 naming the field; never a 500."""
        code, reply = self.post("/tokenize", body)
        self.assertIn(code, (200, 400), reply)
        if code == 400:
            self.assertEqual(set(reply["error"]), {"message", "type", "param", "code"})
        elif body.get("with_pieces") is True:
            for item in reply["tokens"]:
                self.assertEqual(set(item), {"id", "piece"}, reply)
                self.assertIs(type(item["id"]), int)
                piece = item["piece"]  # text, or a piece's byte values when it is not whole UTF-8
                self.assertTrue(isinstance(piece, str) or all(type(b) is int and 0 <= b < 256 for b in piece), reply)
        else:
            self.assertTrue(all(type(t) is int for t in reply["tokens"]), reply)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(DETOKENIZE_BODIES)
    def test_any_detokenize_body(self, body):
        """Any JSON body to /detokenize is a 200 with text, or a 400 on `tokens` when an id is not in the vocabulary."""
        code, reply = self.post("/detokenize", body)
        self.assertIn(code, (200, 400), reply)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        valid = isinstance(tokens, list) and all(
            type(t) is int and 0 <= t < tokenizer().n_vocab for t in tokens)
        self.assertEqual(code == 200, valid, (body, reply))
        if valid:
            self.assertEqual(reply["content"], tokenizer().decode(tokens).decode("utf-8", "replace"))

    def test_not_json_and_wrong_method(self):
        """A body that is not JSON, or content with a lone UTF-16 surrogate, is a 400; GET is a 405."""
        response, content = self.h.fetch("POST", "/tokenize", b"{not json")
        self.assertEqual(response.code, 400)
        response, content = self.h.fetch("POST", "/tokenize", b'{"content": "a\\ud800b"}')
        self.assertEqual((response.code, json.loads(content)["error"]["param"]), (400, "content"))
        response, content = self.h.fetch("GET", "/v1/detokenize")
        self.assertEqual(response.code, 405)


class MetricsMemoryTests(unittest.TestCase):
    """/metrics text and counters."""

    def test_counts_and_format(self):
        """Counters follow the requests (404s fold to endpoint "other"); completions add their usage."""
        h = harness()
        h.backend.cached_tokens = 3
        for _ in range(2):
            self.assertEqual(h.fetch("POST", "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "a b c"}]})[0].code, 200)
        self.assertEqual(h.fetch("POST", "/completions", {"prompt": 5})[0].code, 400)
        self.assertEqual(h.fetch("GET", "/v1/no/such/path")[0].code, 404)
        self.assertEqual(h.fetch("GET", "/health")[0].code, 200)
        response, text = h.fetch("GET", "/metrics")
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["text/plain; version=0.0.4; charset=utf-8"])
        got = samples(text.decode("utf-8"))
        self.assertEqual(got[("krafla_requests_total", (("endpoint", "chat/completions"), ("status", "200")))], 2)
        self.assertEqual(got[("krafla_requests_total", (("endpoint", "completions"), ("status", "400")))], 1)
        self.assertEqual(got[("krafla_requests_total", (("endpoint", "other"), ("status", "404")))], 1)
        self.assertEqual(got[("krafla_requests_total", (("endpoint", "health"), ("status", "200")))], 1)
        results = h.backend.results
        self.assertEqual(got[("krafla_completion_tokens_total", ())], sum(r.completion_tokens for r in results))
        self.assertEqual(got[("krafla_prompt_tokens_cached_total", ())], 6)
        self.assertEqual(got[("krafla_cache_hits_total", ())], 2)
        self.assertEqual(got[("krafla_completions_total", ())], 2)
        # FakeResult: 0.25 s per reply, 0.5 s per prompt
        self.assertAlmostEqual(got[("krafla_generation_tokens_per_second", ())],
                               sum(r.completion_tokens for r in results) / 0.5)
        self.assertAlmostEqual(got[("krafla_prompt_tokens_per_second", ())],
                               sum(r.prompt_tokens - 3 for r in results) / 1.0)
        self.assertEqual(got[("krafla_requests_pending", ())], 0)

    def test_queue_gauges_and_key(self):
        """With one request running and one queued, pending is 2 and queued 1; /metrics needs the API key."""
        h = harness(api_key="k")
        auth = {"Authorization": "Bearer k"}
        body = {"messages": [{"role": "user", "content": "hi"}]}
        h.send("POST", "/v1/chat/completions", body, auth, run=False)
        h.send("POST", "/v1/chat/completions", body, auth, run=False)
        got = samples(h.fetch("GET", "/metrics", headers=auth)[1].decode("utf-8"))
        self.assertEqual((got[("krafla_requests_pending", ())], got[("krafla_requests_queued", ())]), (2, 1))
        h.pool.run_all()
        h.stub.flush()
        self.assertEqual(h.fetch("GET", "/metrics")[0].code, 401)

    def test_without_flag_no_metrics(self):
        """Without --metrics, /metrics is a 404 like any unknown path."""
        h = harness(with_metrics=False)
        self.assertEqual(h.fetch("GET", "/metrics")[0].code, 404)
        self.assertEqual(h.fetch("POST", "/tokenize", {"content": "x"})[0].code, 200)

    def test_endpoint_labels(self):
        """Paths fold onto fixed labels, so clients cannot grow the label set."""
        cases = {b"/v1/chat/completions": "chat/completions", b"/completions/": "completions", b"/v1/models/a/b": "models",
                 b"/metrics": "metrics", b"/v1/tokenize": "tokenize", b"/x" * 50: "other", b"/": "other",
                 b"/v1/chat": "other", b"/v1/responses/resp_1": "responses", b"/messages": "messages",
                 b"/v1/messages/count_tokens": "messages/count_tokens", b"/api/chat": "api/chat",
                 b"/api/pull": "other"}
        for path, label in cases.items():
            self.assertEqual(endpoint_label(path), label, path)

    def test_client_gone_counted(self):
        """A request whose client left is counted as gone, with the tokens it made."""
        m = Metrics()
        m.observe(b"/v1/completions", None, FakeResult("ab", "cancelled", 4, 2), gone=True)
        got = samples(m.render().decode("utf-8"))
        self.assertEqual(got[("krafla_requests_client_gone_total", (("endpoint", "completions"),))], 1)
        self.assertEqual(got[("krafla_completion_tokens_total", ())], 2)
        self.assertNotIn(("krafla_requests_total", (("endpoint", "completions"), ("status", "None"))), got)

    def test_slots_and_batch_histogram(self):
        """With a scheduler: the slots, the busy ones, the requests waiting beyond them (pending minus busy),
        and the sequences per forward step as a Prometheus histogram (cumulative buckets 1..parallel,
        +Inf, sum and count), as prometheus_client's parser reads them."""
        from types import SimpleNamespace

        scheduler = SimpleNamespace(parallel=4, slots_busy=3, steps=10, batch_tokens_total=70, last_batch_sequences=3,
                                    batch_sequences_total=24, batch_histogram=[0, 2, 3, 1, 4])
        got = samples(Metrics(pending=lambda: 5, scheduler=scheduler).render().decode("utf-8"))
        self.assertEqual((got[("krafla_slots", ())], got[("krafla_slots_busy", ())]), (4, 3))
        self.assertEqual((got[("krafla_requests_pending", ())], got[("krafla_requests_queued", ())]), (5, 2))
        self.assertEqual((got[("krafla_batch_steps_total", ())], got[("krafla_batch_tokens_total", ())]), (10, 70))
        self.assertEqual(got[("krafla_batch_sequences_last", ())], 3)
        buckets = [got[("krafla_batch_sequences_bucket", (("le", le),))] for le in ("1", "2", "3", "4", "+Inf")]
        self.assertEqual(buckets, [2, 5, 6, 10, 10])
        self.assertEqual((got[("krafla_batch_sequences_sum", ())], got[("krafla_batch_sequences_count", ())]), (24, 10))
