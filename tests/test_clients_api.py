"""Real clients against a real `twistd -n krafla` with an API key and --metrics: the openai Python
library (sync and async, plain and streamed), curl, /tokenize and /detokenize, and /metrics read with
prometheus_client's own parser.
"""

import asyncio
import json
import os
import subprocess
import threading
import time

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess

KEY = "sk-test-ecosystem"
QUESTION = "What is the capital of France?"
COUNTING = "Count from 1 to 200, separated by commas: 1, 2, 3,"


@pytest.fixture(scope="module")
def model():
    return real_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(model):
    # One slot: the queue gauges below need a request that waits (tests/test_server_concurrency.py has slots).
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2", "--metrics",
                             "--api-key", KEY, "--parallel", "1"]).start()
    yield process
    process.stop()


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def post(server, path, body, root=False):
    url = server.root_url(path) if root else server.url(path)
    return httpx2.post(url, json=body, headers=auth(), timeout=300)


def metrics(server):
    """{(name, frozenset(labels)): value} of every sample /metrics gives, parsed by prometheus_client."""
    response = httpx2.get(server.root_url("/metrics"), headers=auth(), timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


class OpenAIPythonTests:
    """The openai library, sync and async, plain and streamed, with the server's API key."""

    def test_sync_and_async_agree(self, server):
        """Greedy chat replies are the same through OpenAI and AsyncOpenAI, plain or streamed; a wrong key is a 401."""
        from openai import AsyncOpenAI, AuthenticationError, OpenAI

        messages = [{"role": "user", "content": QUESTION}]
        client = OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        plain = client.chat.completions.create(model="local", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="local", messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)

        async def run_async():
            aclient = AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
            reply = await aclient.chat.completions.create(model="local", messages=messages, max_tokens=12, temperature=0)
            pieces = []
            stream = await aclient.chat.completions.create(model="local", messages=messages, max_tokens=12, temperature=0,
                                                           stream=True, stream_options={"include_usage": True})
            usage = None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                if chunk.usage:
                    usage = chunk.usage
            text = await aclient.completions.create(model="local", prompt="The capital of France is", max_tokens=4)
            await aclient.close()
            return reply.choices[0].message.content, "".join(pieces), usage, text

        async_plain, async_streamed, usage, text = asyncio.run(run_async())
        assert "Paris" in plain.choices[0].message.content
        assert streamed == plain.choices[0].message.content == async_plain == async_streamed
        assert usage.completion_tokens == plain.usage.completion_tokens
        assert text.object == "text_completion" and text.usage.completion_tokens == 4
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


class OpenAINodeTests:
    """The openai npm package under node (tests/node/client.mjs), against a server that wants a key."""

    def test_node_client_with_key(self, server):
        """Chat and completions, plain and streamed, agree; the right key is accepted and a wrong one is a 401."""
        node_dir = os.path.join(REPO, "tests", "node")
        if not os.path.isdir(os.path.join(node_dir, "node_modules", "openai")):
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=node_dir, check=True, timeout=600)
        result = subprocess.run(["node", "client.mjs", server.base_url, KEY], cwd=node_dir, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert "Paris" in out["chat"]["content"]
        assert out["chat_stream"]["content"] == out["chat"]["content"]
        assert out["completion_stream"]["text"] == out["completion"]["text"]
        assert out["wrong_key"] == 401


class CurlTests:
    """curl, as the docs show it: streamed with -N, refused without the key."""

    def test_streamed_chat(self, server):
        """`curl -N` gets server-sent events in order, the first with the role, the last `data: [DONE]`."""
        body = json.dumps({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "stream": True,
                           "temperature": 0})
        result = subprocess.run(["curl", "-sS", "-N", server.url("/chat/completions"), "-H", f"Authorization: Bearer {KEY}",
                                 "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        events = [block[len("data: "):] for block in result.stdout.split("\n\n") if block.strip()]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "Paris" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        unauthorized = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", server.url("/models")],
                                      capture_output=True, text=True, timeout=60)
        assert unauthorized.stdout == "401"


class TokenizeTests:
    """/tokenize and /detokenize in llama-server's shapes, checked against the model's own chat template markers."""

    def test_round_trip_and_pieces(self, server):
        """Pieces concatenate to the text's UTF-8 (split characters come as byte lists), and detokenize inverts tokenize."""
        text = "Hello wörld, 日本語 ✓"
        reply = post(server, "/tokenize", {"content": text, "with_pieces": True}, root=True).json()
        raw = b"".join(p["piece"].encode("utf-8") if isinstance(p["piece"], str) else bytes(p["piece"])
                       for p in reply["tokens"])
        assert raw == text.encode("utf-8")
        ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
        assert ids == [p["id"] for p in reply["tokens"]]
        assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text, "prompt": text}

    def test_special_tokens(self, server):
        """parse_special (default true) makes `<|im_start|>` one token; false spells it as text; bad ids are 400s."""
        special = post(server, "/tokenize", {"content": "<|im_start|>"}).json()["tokens"]
        literal = post(server, "/tokenize", {"content": "<|im_start|>", "parse_special": False}).json()["tokens"]
        assert len(special) == 1 and len(literal) > 1
        for body in ({"tokens": [-1]}, {"tokens": [10 ** 9]}, {"tokens": "1 2"}, {"tokens": [True]}):
            response = post(server, "/detokenize", body)
            assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
        response = post(server, "/tokenize", {"content": 5})
        assert response.status_code == 400 and response.json()["error"]["param"] == "content"


class MetricsTests:
    """/metrics counts what the clients saw."""

    def test_counts_follow_requests(self, server):
        """Requests by status, token totals equal to the usage the replies reported, a cache hit on a second turn."""
        before = metrics(server)
        first = [{"role": "user", "content": QUESTION}]
        one = post(server, "/chat/completions", {"messages": first, "max_tokens": 8}).json()
        second = first + [one["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
        two = post(server, "/chat/completions", {"messages": second, "max_tokens": 8}).json()
        assert post(server, "/chat/completions", {"messages": []}).status_code == 400
        assert httpx2.get(server.url("/models"), timeout=60).status_code == 401
        after = metrics(server)

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("krafla_requests_total", endpoint="chat/completions", status="200") == 2
        assert delta("krafla_requests_total", endpoint="chat/completions", status="400") == 1
        assert delta("krafla_requests_total", endpoint="models", status="401") == 1
        assert delta("krafla_completion_tokens_total") == one["usage"]["completion_tokens"] + two["usage"]["completion_tokens"]
        assert delta("krafla_prompt_tokens_total") == one["usage"]["prompt_tokens"] + two["usage"]["prompt_tokens"]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (one, two)]
        assert cached[1] > 0  # the second turn reuses the first's prefix
        assert delta("krafla_prompt_tokens_cached_total") == sum(cached)
        assert delta("krafla_cache_hits_total") == sum(1 for c in cached if c > 0)
        assert value(after, "krafla_generation_tokens_per_second") > 0
        assert value(after, "krafla_prompt_tokens_per_second") > 0
        assert httpx2.get(server.url("/metrics"), timeout=60).status_code == 401

    def test_queue_gauges(self, server):
        """While one streamed reply runs and a second request waits, pending is 2 and queued is 1; then both are 0."""
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        stream = client.completions.create(model="local", prompt=COUNTING, max_tokens=400, stream=True)
        next(iter(stream))  # the first is running
        waiting = threading.Thread(target=lambda: post(server, "/completions", {"prompt": "Hi", "max_tokens": 2}))
        waiting.start()
        deadline = time.monotonic() + 60
        while value(metrics(server), "krafla_requests_pending") != 2:
            assert time.monotonic() < deadline, "the second request never showed as pending"
            time.sleep(0.05)
        assert value(metrics(server), "krafla_requests_queued") == 1
        stream.close()  # the client leaves: generation stops, the waiting request runs
        waiting.join(120)
        deadline = time.monotonic() + 60
        while value(metrics(server), "krafla_requests_pending") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert value(metrics(server), "krafla_requests_queued") == 0
        assert value(metrics(server), "krafla_requests_client_gone_total", endpoint="completions") >= 1


class LiteLLMTests:
    """litellm (and aider, which calls models through it) maps a too-long prompt to its own
    ContextWindowExceededError, on which aider tells the user to shorten the chat."""

    def test_context_window_error_by_message(self):
        """litellm's matcher recognises the message alone (as it does with a provider that sends no
        error code): it begins "This model's maximum context length is N tokens. However, ..." as OpenAI's."""
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price table
        from litellm.litellm_core_utils.exception_mapping_utils import ExceptionCheckers

        from krafla_twisted.generation.generate import ContextLengthExceeded

        message = str(ContextLengthExceeded(5000, 4096))
        assert message.startswith("This model's maximum context length is 4096 tokens. However, ")
        assert ExceptionCheckers.is_error_str_context_window_exceeded(message)

    def test_context_window_error_from_the_server(self, server):
        """litellm.completion against the server with a prompt over the context raises
        litellm.ContextWindowExceededError."""
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model="openai/local", api_base=server.base_url, api_key=KEY, num_retries=0,
                               messages=[{"role": "user", "content": "word " * 5000}], max_tokens=4)
