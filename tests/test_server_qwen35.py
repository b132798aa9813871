"""A real `twistd -n krafla` process serving a tiny random Qwen3.5 model (arch qwen35) with the
real Qwen3.5 vocabulary (tests/data/vocab/ggml-vocab-qwen35.gguf), driven with treq.

A qwen35 session's recurrent state can only be kept whole or dropped, so the server reuses it
only when a request's prompt continues all of the previous one (prompt + reply), and otherwise
starts from an empty state: cached_tokens says which, and a warm reply equals a cold one.

The model is written without torch (tests/support/tiny_qwen35.py). Its output head favours a
few whole-word tokens, so a greedy reply is a run of words that encode back to the same ids
when the next turn sends it as text: the chatml template copies the reply verbatim into the next
prompt, which then continues the previous one exactly. The qwen3.5 templates drop the empty
think block of earlier turns (as the official Jinja template does), so their second turn never
continues the first and must start afresh.
"""

import json
import signal

import pytest

from krafla_twisted.chat.templates import get_template
from krafla_twisted.engine.tokenizer import Tokenizer
from tests.support.server import ServerProcess, treq_call
from tests.support.testdata import vocab_mlt
from tests.support.tiny_qwen35 import write_tiny_qwen35

WORDS = (" the", " cat", " sat", " on", " mat", " dog", " ran", " far")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    mlt = vocab_mlt("qwen35")
    tokenizer = Tokenizer(mlt)
    ids = [tokenizer.encode(word, add_bos=False) for word in WORDS]
    assert all(len(i) == 1 for i in ids), ids
    mlb = write_tiny_qwen35(tmp_path_factory.mktemp("qwen35-server") / "tiny.mlb", seed=5, weight_type="q8_0",
                            n_vocab=tokenizer.n_vocab, dim=32, tied_embeddings=0,
                            favoured_ids=[i[0] for i in ids])
    return mlb, mlt


def start(files, chat):
    mlb, mlt = files
    return ServerProcess([str(mlb), "-z", str(mlt), "--chat", chat, "-t", "1"]).start()


def stop(server):
    assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.lines[-30:])


def chat(server, messages, max_tokens=6):
    status, _, content = treq_call("POST", server.url("/chat/completions"),
                                   {"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, content
    body = json.loads(content)
    return body["choices"][0]["message"]["content"], body["usage"]


class Qwen35ServerTests:
    def test_chat_reuses_the_state_only_when_the_request_continues(self, files):
        """chatml: turn two continues turn one (prompt + reply), so every token of turn one is
        cached; a different conversation, or the same prompt again, starts from an empty state
        (cached_tokens 0), and turn two sent cold gets the warm reply."""
        server = start(files, "chatml")
        try:
            first = [{"role": "user", "content": "Tell me a story."}]
            reply, usage1 = chat(server, first)
            assert reply and set(reply.split()) <= {w.strip() for w in WORDS}, reply
            assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
            second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
            warm, usage2 = chat(server, second)
            # everything evaluated before: turn one's prompt and all reply tokens but the last
            assert usage2["prompt_tokens_details"]["cached_tokens"] == (
                usage1["prompt_tokens"] + usage1["completion_tokens"] - 1)
            # a request that shares only a prefix with the last one cannot cut the state back
            _, usage3 = chat(server, [{"role": "user", "content": "Tell me a joke."}])
            assert usage3["prompt_tokens_details"]["cached_tokens"] == 0
            cold, usage4 = chat(server, second)
            assert usage4["prompt_tokens_details"]["cached_tokens"] == 0
            assert cold == warm
            # the very same request again: its prompt is a prefix of what is cached -> afresh
            again, usage5 = chat(server, second)
            assert usage5["prompt_tokens_details"]["cached_tokens"] == 0
            assert again == warm
        finally:
            stop(server)

    def test_qwen35_template_turns_start_afresh(self, files):
        """qwen3.5-nothink: the second turn's prompt drops turn one's empty think block, so it does
        not continue turn one (checked on the rendered tokens) and the server reports no cached
        tokens; the reply equals the same request's reply on a fresh server."""
        template = get_template("qwen3.5-nothink")
        tokenizer = Tokenizer(files[1])
        first = [{"role": "user", "content": "Tell me a story."}]
        server = start(files, "qwen3.5-nothink")
        try:
            reply, _ = chat(server, first)
            second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
            one, two = template.render(first, tokenizer), template.render(second, tokenizer)
            assert two[:len(one)] != one
            warm, usage = chat(server, second)
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        finally:
            stop(server)
        server = start(files, "qwen3.5-nothink")
        try:
            assert chat(server, second)[0] == warm
        finally:
            stop(server)


class Qwen35ToolTests:
    def test_required_call_in_qwen35_format(self, files, tmp_path):
        """qwen3.5-nothink with tools and tool_choice required: the random model's reply is forced
        into Qwen3.5's XML call format, parsed into tool_calls with arguments typed by the schema,
        and the call with its result renders into the next turn (200). The tools' system prompt
        needs a longer context than the other tests' model has."""
        mlt = files[1]
        mlb = write_tiny_qwen35(tmp_path / "tiny-1k.mlb", seed=5, weight_type="q8_0", n_vocab=Tokenizer(mlt).n_vocab,
                                dim=32, tied_embeddings=0, max_seq=1024)
        server = start((mlb, mlt), "qwen3.5-nothink")
        tool = {"type": "function", "function": {"name": "set_unit", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["unit", "n"]}}}
        try:
            messages = [{"role": "user", "content": "Pick a unit."}]
            status, _, content = treq_call("POST", server.url("/chat/completions"), {
                "messages": messages, "tools": [tool], "tool_choice": "required", "max_tokens": 60, "temperature": 0})
            assert status == 200, content
            choice = json.loads(content)["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            (call,) = choice["message"]["tool_calls"]
            arguments = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "set_unit" and arguments["unit"] in ("C", "F")
            assert isinstance(arguments["n"], int) and 0 <= arguments["n"] <= 9
            messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
            status, _, content = treq_call("POST", server.url("/chat/completions"), {
                "messages": messages, "tools": [tool], "max_tokens": 4, "temperature": 0})
            assert status == 200, content
        finally:
            stop(server)
