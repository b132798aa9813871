"""Request validation: every invalid body gets 400 with the OpenAI error body naming the field; none gets a 500.

Bodies come from hypothesis (tests/strategies.py): a valid request with one field made invalid, any
JSON object at all, and any bytes. The refusals the original lists are pinned one by one.
"""

import json
import unittest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import arbitrary_api_bodies, invalid_api_bodies
from tests.support.fake_backend import APIHarness

PATHS = {"chat": "/v1/chat/completions", "text": "/v1/completions"}
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_error_body(test, body, status_line=""):
    payload = json.loads(body)
    test.assertEqual(set(payload), {"error"}, status_line)
    error = payload["error"]
    test.assertEqual(set(error), {"message", "type", "param", "code"})
    test.assertIsInstance(error["message"], str)
    test.assertTrue(error["message"])
    return error


class InvalidBodyTests(unittest.TestCase):
    """hypothesis-made bodies against the in-memory server."""

    harness = APIHarness()

    @FAST
    @given(st.sampled_from(["chat", "text"]).flatmap(lambda kind: st.tuples(st.just(kind), invalid_api_bodies(kind))))
    def test_one_invalid_field_is_400_naming_it(self, case):
        """A valid request with one field of a wrong type or value: 400, param names that field, engine untouched."""
        kind, (field, body) = case
        calls = len(self.harness.backend.calls)
        response, raw = self.harness.fetch("POST", PATHS[kind], body)
        self.assertEqual(response.code, 400, (body, raw))
        error = assert_error_body(self, raw)
        self.assertEqual(error["type"], "invalid_request_error")
        self.assertTrue((error["param"] or "").startswith(field), (field, error))
        self.assertEqual(len(self.harness.backend.calls), calls)

    @FAST
    @given(st.sampled_from(["chat", "text"]).flatmap(lambda kind: st.tuples(st.just(kind), arbitrary_api_bodies(kind))))
    def test_any_json_object_is_200_or_400(self, case):
        """Any JSON object at all: a reply or a 400 with the error body, never a 500."""
        kind, body = case
        response, raw = self.harness.fetch("POST", PATHS[kind], body)
        self.assertIn(response.code, (200, 400), raw)
        if response.code == 400:
            assert_error_body(self, raw)

    @FAST
    @given(st.binary(max_size=64) | st.text(max_size=32).map(lambda t: t.encode("utf-8")))
    def test_any_bytes_are_400_unless_a_valid_request(self, raw_body):
        """Any bytes as the body of either endpoint: 200 or a 400 with the error body."""
        for path in PATHS.values():
            response, raw = self.harness.fetch("POST", path, raw_body)
            self.assertIn(response.code, (200, 400))
            if response.code == 400:
                assert_error_body(self, raw)


class ParseErrorTests(unittest.TestCase):
    """Bodies that are not a JSON object."""

    def test_not_json(self):
        """Empty, not JSON, NaN, deep nesting, a JSON array, a JSON string: 400 with the error body."""
        harness = APIHarness()
        for raw in (b"", b"   ", b"{", b"not json", b'{"prompt": NaN}', b"[" * 100000 + b"]" * 100000, b"[]", b'"x"', b"\xff\xfe"):
            response, body = harness.fetch("POST", "/v1/completions", raw)
            self.assertEqual(response.code, 400, raw[:20])
            assert_error_body(self, body)


class RefusalTests(unittest.TestCase):
    """What the original refuses and still does: legacy functions, images; and
    the new fields' bad values (top_logprobs without logprobs, logit_bias out of range, unknown response_format)."""

    def setUp(self):
        self.harness = APIHarness()

    def refused(self, path, body, param):
        response, raw = self.harness.fetch("POST", path, body)
        self.assertEqual(response.code, 400, body)
        error = assert_error_body(self, raw)
        self.assertEqual(error["param"], param, body)
        return error

    def test_chat_refusals(self):
        """Each chat refusal is a 400 naming the field; the harmless values of the same fields are accepted."""
        base = {"messages": [{"role": "user", "content": "hi"}]}
        for extra, param in (({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                             ({"functions": [{"name": "f"}]}, "functions"),
                             ({"response_format": {"type": "xml"}}, "response_format.type"),
                             ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                             ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                             ({"tool_choice": "required"}, "tool_choice"),
                             ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
                             ({"n": 129}, "n"), ({"n": 0}, "n"),
                             ({"grammar": 5}, "grammar"), ({"json_schema": "x"}, "json_schema"),
                             ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
                             ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar"),
                             ({"json_schema": {}, "response_format": {"type": "json_object"}}, "json_schema"),
                             ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f"}}]},
                              "grammar"),
                             ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
                             ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
                             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                              "messages[0].content[0]")):
            error = self.refused("/v1/chat/completions", dict(base, **extra), param)
            self.assertEqual(error["type"], "invalid_request_error")
        for harmless in ({"logprobs": False}, {"tools": []}, {"response_format": {"type": "text"}}, {"n": 1}, {"n": 3},
                         {"top_logprobs": None}, {"tool_choice": "none"}, {"grammar": 'root ::= "a"'}, {"grammar": ""},
                         {"json_schema": {"type": "object"}}):
            response, _ = self.harness.fetch("POST", "/v1/chat/completions", dict(base, **harmless))
            self.assertEqual(response.code, 200, harmless)

    def test_logit_bias_ids_outside_the_vocabulary(self):
        """A logit_bias id at the model's vocabulary size is a 400 on logit_bias from both endpoints,
        refused before the request reaches the engine; the last id of the vocabulary is accepted."""
        n_vocab = self.harness.backend.n_vocab
        for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            calls = len(self.harness.backend.calls)
            error = self.refused(path, dict(base, logit_bias={str(n_vocab): 1}), "logit_bias")
            self.assertIn(f"token {n_vocab},", error["message"])
            self.assertEqual(len(self.harness.backend.calls), calls, path)
            response, _ = self.harness.fetch("POST", path, dict(base, logit_bias={str(n_vocab - 1): 1}))
            self.assertEqual(response.code, 200, path)

    def test_completion_refusals(self):
        """echo with a suffix, max_tokens 0 without echo, best_of below n or streamed, logprobs above 5, more than 128
        choices (n times the prompts), an empty or nested prompt in a batch, and a suffix that is not text
        or follows token ids are refused for completions."""
        for extra, param in (({"echo": True, "suffix": "end"}, "echo"), ({"max_tokens": 0}, "max_tokens"),
                             ({"echo": True, "max_tokens": -1}, "max_tokens"), ({"echo": 1}, "echo"),
                             ({"suffix": 5}, "suffix"), ({"prompt": [1, 2], "suffix": "end"}, "suffix"),
                             ({"best_of": 2, "n": 3}, "best_of"), ({"best_of": 129}, "best_of"),
                             ({"best_of": 2, "stream": True}, "best_of"), ({"best_of": 65, "prompt": ["a", "b"]}, "best_of"),
                             ({"logprobs": 6}, "logprobs"), ({"logit_bias": {"1": -101}}, "logit_bias"),
                             ({"n": 65, "prompt": ["a", "b"]}, "n"), ({"prompt": ["a"] * 129}, "prompt"),
                             ({"prompt": [[1, 2], []]}, "prompt"), ({"prompt": [[[1]]]}, "prompt"),
                             ({"prompt": [[1], [2]], "suffix": "end"}, "suffix")):
            self.refused("/v1/completions", dict({"prompt": "hi"}, **extra), param)
        for harmless in ({"echo": False}, {"suffix": None}, {"best_of": 1}, {"logprobs": None}, {"prompt": ["one"]},
                         {"echo": True}, {"echo": True, "max_tokens": 0}, {"n": 2}, {"prompt": ["a", [1, 2]], "n": 64}):
            response, _ = self.harness.fetch("POST", "/v1/completions", dict({"prompt": "hi"}, **harmless))
            self.assertEqual(response.code, 200, harmless)

    def test_suffix_reaches_the_backend(self):
        """A text prompt with a suffix is a fill-in-the-middle request: the backend gets both texts (whether the
        model can fill in is the backend's to say); an empty suffix is none."""
        for suffix, expected in (("\n    return c\n", "\n    return c\n"), ("", None)):
            response, _ = self.harness.fetch("POST", "/v1/completions", {"prompt": "def f(a, b):", "suffix": suffix})
            self.assertEqual(response.code, 200, suffix)
            completion = self.harness.backend.calls[-1]
            self.assertEqual((completion.prompt_text, completion.suffix), ("def f(a, b):", expected))

    def test_stream_options_need_stream(self):
        """stream_options without stream is refused; include_usage must be a boolean."""
        self.refused("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options")
        self.refused("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
                     "stream_options.include_usage")

    def test_lone_surrogates_refused(self):
        """JSON escapes of lone surrogates are not text: 400 on the field, for prompt, content, parts and stop."""
        self.refused("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt")
        self.refused("/v1/completions", b'{"prompt": "ab", "stop": ["\\udfff"]}', "stop")
        self.refused("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content")
        self.refused("/v1/chat/completions",
                     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
                     "messages[0].content[0]")
        response, _ = self.harness.fetch("POST", "/v1/completions", b'{"prompt": "\\ud83d\\ude00"}')  # a valid pair
        self.assertEqual(response.code, 200)

    def test_token_ids_checked_against_vocabulary(self):
        """Token ids must be 0 <= id < n_vocab (the fake's 1000)."""
        self.refused("/v1/completions", {"prompt": [1, 1000]}, "prompt")
        self.refused("/v1/completions", {"prompt": [-1]}, "prompt")
        self.refused("/v1/completions", {"prompt": [1, True]}, "prompt")
        response, _ = self.harness.fetch("POST", "/v1/completions", {"prompt": [0, 999]})
        self.assertEqual(response.code, 200)
