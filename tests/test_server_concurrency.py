"""Many clients at once against a real `twistd -n krafla --parallel 4` with the real SmolLM2 model.

Each request is first sent alone, then all of them together (more than there are slots, so some
wait): the openai Python library streams some, treq others; one client leaves midway; some carry
stop strings, some share a long prompt prefix, some sample at T > 0 with a seed. Every reply's
stream, chunk by chunk, must be what the same request got alone (the ids and timestamps aside),
and /metrics must show steps that really held several sequences. Then the slots: a request takes
the slot holding the longest prefix of its prompt, which usage.prompt_tokens_details.cached_tokens
reports.
"""

import json
import threading

import httpx2
import pytest
import treq
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer

from tests.support.real_models import real_model
from tests.support.server import ServerProcess, in_reactor

PARALLEL = 4
SHARED = ("You are a careful assistant who answers in full sentences and never uses lists. "
          "Every answer names the country it is about. ") * 3


@pytest.fixture(scope="module")
def server():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2", "--metrics",
                             "--parallel", str(PARALLEL), "--ctx", "1024"]).start()
    yield process
    process.stop()


def chat(content, system=None, **extra):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return dict({"model": "local", "messages": messages, "max_tokens": 24}, **extra)


REQUESTS = [
    ("openai", chat("What is the capital of France?")),
    ("treq", chat("What is the capital of Spain?", system=SHARED)),
    ("openai", chat("What is the capital of Italy?", system=SHARED)),
    ("treq", chat("Count from 1 to 30: 1, 2, 3,", stop=["9"], max_tokens=60)),
    ("openai", chat("Write a line about the sea.", temperature=0.9, seed=7)),
    ("treq", chat("Write a line about the sky.", temperature=0.8, top_p=0.9, seed=12345)),
    ("cancel", chat("Count from 1 to 100: 1, 2, 3,", max_tokens=200)),
    ("openai", chat("Name three rivers of Europe.", system=SHARED, stop=["Danube", "\n\n"])),
]
CANCEL_AFTER = 4  # the leaving client reads this many chunks, then closes its connection


def shape(chunks):
    """What a stream says, chunk by chunk, without its id and timestamp."""
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) if c.get("choices") else c for c in chunks]


def via_openai(server, body, leave_after=None):
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    fields = {k: v for k, v in body.items() if k not in ("model", "messages")}
    stream = client.chat.completions.create(model="local", messages=body["messages"], stream=True, **fields)
    chunks = []
    for chunk in stream:
        chunks.append(json.loads(chunk.model_dump_json(exclude_unset=True)))
        if leave_after is not None and len(chunks) == leave_after:
            stream.close()
            break
    return shape(chunks)


def via_treq(server, body):
    @defer.inlineCallbacks
    def go():
        response = yield treq.post(server.url("/chat/completions"), data=json.dumps(dict(body, stream=True)).encode(),
                                   headers={"Content-Type": "application/json"}, persistent=False)
        content = yield response.content()
        assert response.code == 200
        return content

    raw = in_reactor(go).decode("utf-8")
    events = [block[len("data: "):] for block in raw.split("\n\n") if block.strip()]
    assert events[-1] == "[DONE]"
    return shape([json.loads(event) for event in events[:-1]])


def run(server, kind, body):
    if kind == "openai":
        return via_openai(server, body)
    if kind == "treq":
        return via_treq(server, body)
    return via_openai(server, body, leave_after=CANCEL_AFTER)


def histogram(server):
    """{sample name and le: value} of krafla_batch_sequences, and the slot gauges, parsed by prometheus_client."""
    text = httpx2.get(server.root_url("/metrics"), timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("le"))] = sample.value
    return out


class ConcurrencyTests:
    def test_each_reply_as_alone(self, server):
        """Eight streamed requests at once on four slots (openai and treq clients; stop strings, shared
        prefixes, seeded T > 0, one client that leaves after four chunks) each get the chunks they get
        alone; /metrics shows forward steps that held more than one sequence, and every slot free after."""
        alone = [run(server, kind, body) for kind, body in REQUESTS]
        assert all(len(chunks) > 2 for chunks in alone)
        before = histogram(server)
        together = [None] * len(REQUESTS)
        ready = threading.Barrier(len(REQUESTS))

        def client(index):
            kind, body = REQUESTS[index]
            ready.wait(60)
            together[index] = run(server, kind, body)

        threads = [threading.Thread(target=client, args=(index,)) for index in range(len(REQUESTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        for index, (kind, body) in enumerate(REQUESTS):
            assert together[index] == alone[index], (kind, body)
        after = histogram(server)
        steps = after[("krafla_batch_sequences_count", None)] - before[("krafla_batch_sequences_count", None)]
        single = after[("krafla_batch_sequences_bucket", "1")] - before[("krafla_batch_sequences_bucket", "1")]
        assert steps > single, "no forward step held two sequences"
        assert after[("krafla_slots", None)] == PARALLEL
        server.wait_for(lambda line: "client gone" in line)
        assert histogram(server)[("krafla_slots_busy", None)] == 0

    def test_longest_prefix_slot_and_cached_tokens(self, server):
        """A follow-up takes the slot whose cache holds its conversation, not the least recently used one,
        although an unrelated chat (sharing the template's header) came in between: cached_tokens counts
        the whole earlier prompt."""
        def ask(messages):
            response = httpx2.post(server.url("/chat/completions"), json={"messages": messages, "max_tokens": 8},
                                   timeout=300)
            assert response.status_code == 200
            return response.json()

        first = [{"role": "user", "content": "Iceland has glaciers, volcanoes, black sand beaches, geysers and long "
                                             "winter nights. Name one of its mountains, in one word."}]
        one = ask(first)
        ask([{"role": "user", "content": "Say something about penguins and ice floes."}])  # the most recent slot
        follow = first + [one["choices"][0]["message"], {"role": "user", "content": "And a river?"}]
        again = ask(follow)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"]

    def test_choices_side_by_side(self, server):
        """A seeded chat with n 4 on four slots runs its choices in the same forward steps, and each
        choice is the reply a request with n 1 and seed + index gets alone; a client that leaves a
        streamed n 4 request frees every slot."""
        client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        body = chat("Write a line about the sea.", temperature=0.9, seed=70)
        fields = {k: v for k, v in body.items() if k not in ("model", "messages")}
        alone = []
        for index in range(PARALLEL):
            reply = client.chat.completions.create(model="local", messages=body["messages"], **dict(fields, seed=70 + index))
            alone.append(reply.choices[0].message.content)
        before = histogram(server)
        together = client.chat.completions.create(model="local", messages=body["messages"], n=PARALLEL, **fields)
        assert [c.message.content for c in together.choices] == alone
        after = histogram(server)
        full = after[("krafla_batch_sequences_count", None)] - after[("krafla_batch_sequences_bucket", str(PARALLEL - 1))]
        full_before = before[("krafla_batch_sequences_count", None)] - before[("krafla_batch_sequences_bucket", str(PARALLEL - 1))]
        assert full > full_before, "no forward step held all four choices"
        start = len(server.lines)
        stream = client.chat.completions.create(model="local", messages=body["messages"], n=PARALLEL, stream=True,
                                                **dict(fields, max_tokens=200))
        for count, _ in enumerate(stream):
            if count == 3:
                stream.close()
                break
        server.wait_for(lambda line: "client gone" in line, start=start)
        assert histogram(server)[("krafla_slots_busy", None)] == 0
