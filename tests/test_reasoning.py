"""A thinking template's reasoning split from its answer (krafla_twisted/generation/reasoning.py), and
each API writing it in its own field: Chat Completions' reasoning_content, a Responses reasoning item,
an Anthropic thinking block, Ollama's thinking. In memory, over tests/support/fake_backend.py."""

import json
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from krafla_twisted.generation import tools
from krafla_twisted.generation.reasoning import ReasoningStream, split_reasoning
from tests.support.fake_backend import APIHarness, FakeBackend, sse_events

REASONING = "Let me think.\nTwo and two.\n"
ANSWER = "The answer is 4."
PIECES = ("Let me", " think.\nTwo and two.\n</th", "ink>\n", "\nThe ", "answer is 4.")


def streamed(pieces, opened=True):
    stream = ReasoningStream(opened)
    reasoning, answer = [], []
    for piece in pieces:
        r, a = stream.push(piece)
        reasoning.append(r)
        answer.append(a)
    r, a = stream.finish()
    return "".join(reasoning) + r, "".join(answer) + a


def cut(text, points):
    """`text` cut at `points` (indices), in order."""
    bounds = [0, *sorted(set(p % (len(text) + 1) for p in points)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_reasoning_then_call(backend):
    """A reply that reasons "I should call it." and then calls f(x=1) through `backend`: whole, the
    reasoning and the call with no content; streamed, the same in the deltas."""
    harness = APIHarness(backend)
    body = dict(CHAT, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}])
    choice = json.loads(post(harness, "/v1/chat/completions", body))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I should call it." and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    events = sse_events(post(harness, "/v1/chat/completions", dict(body, stream=True)))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call it."
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["f"]


class TestSplitter:
    def test_whole_text(self):
        assert split_reasoning(REASONING + "</think>\n\n" + ANSWER) == (REASONING, ANSWER)

    def test_never_closed_is_all_reasoning(self):
        # max_tokens in the middle of the thinking: nothing is answered yet, even a partial tag
        assert split_reasoning("Hmm, so </thi") == ("Hmm, so </thi", "")
        assert streamed(["Hmm, so </", "thi"]) == ("Hmm, so </thi", "")

    def test_model_opens_the_block(self):
        # Qwen3, SmolLM3: the model writes <think> itself; without it there is no reasoning
        assert split_reasoning("<think>\nR</think>\n\nA", opened=False) == ("\nR", "A")
        assert streamed(["\n<th", "ink>R</think>\n\nA"], opened=False) == ("R", "A")
        assert split_reasoning("Just an answer", opened=False) == ("", "Just an answer")
        assert streamed(["<", "b>bold</b>"], opened=False) == ("", "<b>bold</b>")

    def test_only_the_first_close_tag_ends_the_reasoning(self):
        assert split_reasoning("R</think>\n\nA </think> B") == ("R", "A </think> B")

    @given(st.text(max_size=40).filter(lambda r: "</think>" not in r),
           st.text(max_size=40).filter(lambda a: not a.startswith("\n")),
           st.lists(st.integers(min_value=0, max_value=200), max_size=12),
           st.sampled_from(["", "\n", "\n\n", "\n\n\n"]))
    def test_any_split_streams_to_the_whole(self, reasoning, answer, points, gap):
        """Any cut of R</think>GAP A streams to the same (R, A) as the whole text (R holds no close
        tag; the gap is the blank lines the splitter drops)."""
        text = reasoning + "</think>" + gap + answer
        assert split_reasoning(text) == (reasoning, answer)
        assert streamed(cut(text, points)) == (reasoning, answer)

    @given(st.text(max_size=40), st.lists(st.integers(min_value=0, max_value=100), max_size=8))
    def test_no_close_tag_is_all_reasoning(self, reasoning, points):
        reasoning = reasoning.replace("</think>", "")
        assert split_reasoning(reasoning) == streamed(cut(reasoning, points)) == (reasoning, "")


class ThinkingBackend(FakeBackend):
    """The scripted backend with a Qwen3.5-like thinking template: the reply starts inside <think>."""

    template = SimpleNamespace(thinking=True, opens_think=True)

    def __init__(self, pieces=PIECES, **kwargs):
        super().__init__(pieces=pieces, **kwargs)


CHAT = {"messages": [{"role": "user", "content": "What is two and two?"}]}


def post(harness, path, body):
    response, raw = harness.fetch("POST", path, body)
    assert response.code == 200, raw
    return raw


class TestChatCompletions:
    def test_whole_and_streamed(self):
        harness = APIHarness(ThinkingBackend())
        reply = json.loads(post(harness, "/v1/chat/completions", CHAT))
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == REASONING and message["content"] == ANSWER
        # the reasoning's tokens: through the one that completes </think> (the third of PIECES)
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
        events = sse_events(post(harness, "/v1/chat/completions", dict(CHAT, stream=True)))
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
        assert "".join(d.get("content", "") for d in deltas) == ANSWER
        # the reasoning goes out before any of the answer
        kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
        assert kinds == sorted(kinds, key=lambda k: k == "content")

    def test_tool_call_is_read_from_the_answer(self):
        backend = ThinkingBackend(pieces=("I should call it.", "</think>\n\n<tool_call>\n<function=f>\n",
                                          "<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"))
        backend.tool_format = tools.FORMATS["qwen3.5"]
        check_reasoning_then_call(backend)

    def test_unfinished_thinking_is_all_reasoning(self):
        harness = APIHarness(ThinkingBackend())
        reply = json.loads(post(harness, "/v1/chat/completions", dict(CHAT, max_tokens=2)))
        choice = reply["choices"][0]
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
        assert choice["finish_reason"] == "length"
        assert choice["message"]["reasoning_content"] == "Let me think.\nTwo and two.\n</th"
        assert choice["message"]["content"] == ""

    def test_non_thinking_template_is_unchanged(self):
        harness = APIHarness(FakeBackend(pieces=PIECES))
        reply = json.loads(post(harness, "/v1/chat/completions", CHAT))
        message = reply["choices"][0]["message"]
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        assert "reasoning_content" not in message and message["content"] == "".join(PIECES)


def named_events(raw):
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.strip():
            name_line, data_line = block.split("\n")
            out.append((name_line[len("event: "):], json.loads(data_line[len("data: "):])))
    return out


class TestResponses:
    def test_whole_and_streamed(self):
        harness = APIHarness(ThinkingBackend())
        whole = json.loads(post(harness, "/v1/responses", {"input": "What is two and two?"}))
        reasoning, message = whole["output"]
        assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_") and reasoning["summary"] == []
        assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
        assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
        assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
        events = named_events(post(harness, "/v1/responses", {"input": "What is two and two?", "stream": True}))
        names = [name for name, _ in events]
        assert "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta") == REASONING
        assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == ANSWER
        assert names.index("response.reasoning_text.done") < names.index("response.content_part.added")
        added = [d for n, d in events if n == "response.output_item.added"]
        assert [(d["output_index"], d["item"]["type"]) for d in added] == [(0, "reasoning"), (1, "message")]
        done = [d for n, d in events if n == "response.output_item.done"]
        assert [d["item"] for d in done] == [reasoning | {"id": done[0]["item"]["id"]},
                                             message | {"id": done[1]["item"]["id"]}]
        assert all(d["output_index"] == 1 for n, d in events if n == "response.output_text.delta")
        final = events[-1][1]["response"]
        assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
        assert final["output"][0]["content"] == reasoning["content"]


TOOL_PIECES = ("I should call it.", "</think>\n\n<tool_call>\n<function=f>\n",
               "<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>")
TOOL = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def tool_backend():
    backend = ThinkingBackend(pieces=TOOL_PIECES)
    backend.tool_format = tools.FORMATS["qwen3.5"]
    return backend


class TestToolCallsAfterReasoning:
    def test_responses(self):
        harness = APIHarness(tool_backend())
        body = {"input": "Call f.", "tools": [dict(TOOL, type="function")]}
        whole = json.loads(post(harness, "/v1/responses", body))
        assert [item["type"] for item in whole["output"]] == ["reasoning", "function_call"]
        assert whole["output"][0]["content"][0]["text"] == "I should call it."
        events = named_events(post(harness, "/v1/responses", dict(body, stream=True)))
        added = [d for n, d in events if n == "response.output_item.added"]
        assert [(d["output_index"], d["item"]["type"]) for d in added] == [(0, "reasoning"), (1, "function_call")]
        assert not [n for n, _ in events if n.startswith("response.output_text")]

    def test_anthropic(self):
        harness = APIHarness(tool_backend())
        body = dict(TestAnthropic.BODY, tools=[{"name": "f", "input_schema": TOOL["parameters"]}])
        whole = json.loads(post(harness, "/v1/messages", body))
        assert [block["type"] for block in whole["content"]] == ["thinking", "tool_use"]
        assert whole["stop_reason"] == "tool_use" and whole["content"][1]["input"] == {"x": 1}
        events = [data for _, data in named_events(post(harness, "/v1/messages", dict(body, stream=True)))]
        starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
        assert starts == ["thinking", "tool_use"]


class TestAnthropic:
    BODY = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "What is two and two?"}]}

    def test_whole_and_streamed(self):
        harness = APIHarness(ThinkingBackend())
        whole = json.loads(post(harness, "/v1/messages", self.BODY))
        assert whole["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                    {"type": "text", "text": ANSWER}]
        raw = post(harness, "/v1/messages", dict(self.BODY, stream=True))
        events = [data for _, data in named_events(raw)]
        starts = [e for e in events if e["type"] == "content_block_start"]
        assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "thinking"), (1, "text")]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == REASONING
        assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == ANSWER
        stops = [i for i, e in enumerate(events) if e["type"] == "content_block_stop"]
        assert [events[i]["index"] for i in stops] == [0, 1]
        assert stops[0] < events.index(starts[1])


class TestOllama:
    def test_chat_whole_and_streamed(self):
        harness = APIHarness(ThinkingBackend())
        body = dict(CHAT, model="m")
        whole = json.loads(post(harness, "/api/chat", dict(body, stream=False)))
        assert whole["message"]["thinking"] == REASONING and whole["message"]["content"] == ANSWER
        chunks = [json.loads(line) for line in post(harness, "/api/chat", body).splitlines() if line.strip()]
        assert "".join(c["message"].get("thinking", "") for c in chunks) == REASONING
        assert "".join(c["message"]["content"] for c in chunks) == ANSWER

    def test_generate(self):
        harness = APIHarness(ThinkingBackend())
        body = {"model": "m", "prompt": "What is two and two?"}
        whole = json.loads(post(harness, "/api/generate", dict(body, stream=False)))
        assert whole["thinking"] == REASONING and whole["response"] == ANSWER
        chunks = [json.loads(line) for line in post(harness, "/api/generate", body).splitlines() if line.strip()]
        assert "".join(c.get("thinking", "") for c in chunks) == REASONING
        assert "".join(c["response"] for c in chunks) == ANSWER


class TestRealServer:
    """A real `twistd -n krafla` over a tiny random Qwen3.5 model with the thinking `qwen3.5` template
    (tests/support/tiny_qwen35.py): the random model never closes its think block, so a reply is all
    reasoning, with tools too (the tool grammar lets the reasoning run on)."""

    def test_thinking_reply_and_tool_call(self, tmp_path):
        import signal

        from krafla_twisted.engine.tokenizer import Tokenizer
        from tests.support.server import ServerProcess, treq_call
        from tests.support.testdata import vocab_mlt
        from tests.support.tiny_qwen35 import write_tiny_qwen35

        mlt = vocab_mlt("qwen35")
        mlb = write_tiny_qwen35(tmp_path / "tiny.mlb", seed=5, weight_type="q8_0", n_vocab=Tokenizer(mlt).n_vocab,
                                dim=32, tied_embeddings=0, max_seq=1024)
        server = ServerProcess([str(mlb), "-z", str(mlt), "--chat", "qwen3.5", "-t", "1"]).start()

        def call(body):
            status, _, content = treq_call("POST", server.url("/chat/completions"), dict(body, temperature=0))
            assert status == 200, content
            return content

        try:
            body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8}
            choice = json.loads(call(body))["choices"][0]
            assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
            assert choice["message"]["reasoning_content"]
            deltas = [e["choices"][0]["delta"] for e in sse_events(call(dict(body, stream=True)))[:-1]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
            assert not "".join(d.get("content") or "" for d in deltas)
            tool = {"type": "function", "function": {"name": "set_unit", "parameters": {
                "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}}}
            body = dict(body, tools=[tool], tool_choice="required", max_tokens=80)
            choice = json.loads(call(body))["choices"][0]
            # the grammar lets the random model reason on (no `<`) until max_tokens: no call yet
            assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
            assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
        finally:
            assert server.stop() in (0, -signal.SIGTERM), "\n".join(server.lines[-30:])


class HarmonySplitTests:
    """gpt-oss's replies (harmony channels, written with their control tokens) split into reasoning
    and answer, its tool calls left for tools.HarmonyFormat."""

    def test_analysis_is_reasoning_final_is_answer(self):
        """The analysis channel's body is the reasoning, the final channel's the answer; a
        commentary preamble without a recipient is answer too."""
        from krafla_twisted.generation.reasoning import split_harmony

        reply = ("<|channel|>analysis<|message|>" + REASONING + "<|end|><|start|>assistant<|channel|>commentary"
                 "<|message|>One moment. <|end|><|start|>assistant<|channel|>final<|message|>" + ANSWER)
        assert split_harmony(reply) == (REASONING, "One moment. " + ANSWER)
        assert split_harmony(ANSWER) == ("", ANSWER)

    @given(arguments=st.dictionaries(st.sampled_from(["city", "n", "é"]), st.integers() | st.text(max_size=5),
                                     max_size=3),
           recipient_first=st.booleans())
    def test_call_is_read_back(self, arguments, recipient_first):
        """A call after the reasoning, the recipient before or after the channel (`<|constrain|>json`
        as the model writes it, or the template's `json`), is the call and no content."""
        from krafla_twisted.chat.templates import ToolCall, tool_json
        from krafla_twisted.generation.reasoning import split_harmony

        header = ("assistant to=functions.get_weather<|channel|>commentary json" if recipient_first
                  else "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json")
        reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>" + header + "<|message|>"
                 + tool_json(arguments))
        reasoning, answer = split_harmony(reply)
        assert reasoning == "Need the weather."
        assert tools.FORMATS["harmony"].parse(answer, []) == (None, [ToolCall("get_weather", arguments)])

    def test_call_right_after_the_generation_prompt(self):
        """A reply that is a call from its first token (as the required-call grammar makes it:
        ` to=functions.f<|channel|>commentary json<|message|>...`) is that call."""
        from krafla_twisted.chat.templates import HARMONY_GENERATION_PROMPT, ToolCall, harmony_tool_call_text
        from krafla_twisted.generation.reasoning import split_harmony

        call = ToolCall("f", {"x": 1})
        reasoning, answer = split_harmony(harmony_tool_call_text(call)[len(HARMONY_GENERATION_PROMPT):])
        assert reasoning == "" and tools.FORMATS["harmony"].parse(answer, []) == (None, [call])

    @given(cuts=st.lists(st.integers(0, 200), max_size=8), call=st.booleans())
    def test_streamed_pieces_add_up_to_the_whole(self, cuts, call):
        """However a gpt-oss reply is cut into pieces (inside markers too), the streamed reasoning
        and answer join to split_harmony's of the whole reply."""
        from krafla_twisted.generation.reasoning import HarmonyStream, split_harmony

        reply = HARMONY_CALL if call else HARMONY_REPLY
        points = sorted(min(c, len(reply)) for c in cuts)
        stream = HarmonyStream()
        reasoning, answer = [], []
        for piece in [reply[a:b] for a, b in zip([0] + points, points + [len(reply)])]:
            r, a = stream.push(piece)
            reasoning.append(r)
            answer.append(a)
        r, a = stream.finish()
        assert ("".join(reasoning) + r, "".join(answer) + a) == split_harmony(reply)


HARMONY_REPLY = ("<|channel|>analysis<|message|>" + REASONING + "<|end|><|start|>assistant<|channel|>final"
                 "<|message|>" + ANSWER)
HARMONY_CALL = ("<|channel|>analysis<|message|>I should call it.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.f <|constrain|>json<|message|>{\"x\": 1}")


def harmony_pieces(text, size=7):
    return tuple(text[i:i + size] for i in range(0, len(text), size))


class HarmonyBackend(FakeBackend):
    """The scripted backend with gpt-oss's harmony template: replies in channels."""

    template = SimpleNamespace(thinking=True, reasoning_format="harmony")

    def __init__(self, pieces=harmony_pieces(HARMONY_REPLY), **kwargs):
        super().__init__(pieces=pieces, **kwargs)


class TestHarmonyChatCompletions:
    def test_whole_and_streamed(self):
        """The analysis channel is reasoning_content, the final channel content, whole and streamed
        (the reasoning's tokens: through the one completing its <|end|>)."""
        harness = APIHarness(HarmonyBackend())
        reply = json.loads(post(harness, "/v1/chat/completions", CHAT))
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == REASONING and message["content"] == ANSWER
        end = HARMONY_REPLY.index("<|end|>") + len("<|end|>")
        assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": -(-end // 7)}
        events = sse_events(post(harness, "/v1/chat/completions", dict(CHAT, stream=True)))
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
        assert "".join(d.get("content", "") for d in deltas) == ANSWER

    def test_tool_call(self):
        """A commentary message to functions.f is a tool call, whole and streamed, with no content."""
        backend = HarmonyBackend(pieces=harmony_pieces(HARMONY_CALL))
        backend.tool_format = tools.FORMATS["harmony"]
        check_reasoning_then_call(backend)
