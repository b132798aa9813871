"""The backend: a validated request mapped onto generation/generate.py with the real SmolLM2 model, in process.

Pins the mapping itself: the server's option defaults under the request's fields, -n as the default
max_tokens, chat stop strings, and the generator's and renderer's refusals turned into OpenAI 400s.
"""

import pytest

from krafla_twisted.api.backend import Backend
from krafla_twisted.api.errors import ContextTooLong, InvalidRequest
from krafla_twisted.api.schema import CompletionRequest, SamplingOverrides
from krafla_twisted.cli import startup
from tests.support.real_models import real_model


def backend_for(**options):
    model = real_model("smollm2-135m")
    config = dict({"model": str(model.mlb), "tokenizer": str(model.mlt), "threads": 2}, **options)
    return Backend(startup.load_runtime(config), model_id="test")


@pytest.fixture(scope="module")
def backend():
    backend = backend_for(chat="gemma", temperature=0.5, **{"top-k": 7, "max-tokens": 3, "ctx": 64})
    yield backend
    backend.runtime.close()


class BackendTests:
    """Backend.complete with the real engine."""

    def test_request_fields_over_server_defaults(self, backend):
        """Fields a request leaves out keep the server's options (-T 0.5, --top-k 7); the ones it sets win."""
        sampling = backend.sampling(SamplingOverrides(top_k=3, seed=9))
        assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.top_p) == (0.5, 3, 9, 0.9)

    def test_default_max_tokens_is_dash_n(self, backend):
        """Without max_tokens the reply is capped by -n (3 here); with it, by the request."""
        result = backend.complete(CompletionRequest(kind="text", prompt_text="1, 2, 3,", sampling=SamplingOverrides(temperature=0.0)),
                                  on_text=None, cancelled=lambda: False)
        assert (result.completion_tokens, result.finish_reason) == (3, "length")
        result = backend.complete(CompletionRequest(kind="text", prompt_text="1, 2, 3,", max_tokens=1), on_text=None,
                                  cancelled=lambda: False)
        assert result.completion_tokens == 1

    def test_template_refusal_is_400(self, backend):
        """A conversation the template cannot render (gemma: a system message after the first) is a 400 on messages."""
        messages = ({"role": "user", "content": "a"}, {"role": "system", "content": "b"})
        with pytest.raises(InvalidRequest) as caught:
            backend.complete(CompletionRequest(kind="chat", messages=messages), on_text=None, cancelled=lambda: False)
        assert caught.value.param == "messages" and caught.value.status == 400

    def test_context_and_empty_prompt(self, backend):
        """A prompt over --ctx is context_length_exceeded on its field; an empty text prompt is a 400."""
        with pytest.raises(ContextTooLong) as caught:
            backend.complete(CompletionRequest(kind="text", prompt_tokens=tuple(range(1, 100))), on_text=None,
                             cancelled=lambda: False)
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")
        with pytest.raises(ContextTooLong) as caught:
            backend.complete(CompletionRequest(kind="chat", messages=({"role": "user", "content": "word " * 80},)),
                             on_text=None, cancelled=lambda: False)
        assert caught.value.param == "messages"
        assert not backend.tokenizer.add_bos  # SmolLM2 adds no BOS, so "" is no tokens at all
        with pytest.raises(InvalidRequest) as caught:
            backend.complete(CompletionRequest(kind="text", prompt_text=""), on_text=None, cancelled=lambda: False)
        assert caught.value.param == "prompt"

    def test_stop_strings_passed_on(self, backend):
        """A chat's stop strings are the request's plus the template's; a text completion's only the request's."""
        seen = [backend.begin(CompletionRequest(kind="chat", messages=({"role": "user", "content": "x"},), stop=("END",)),
                              on_text=None, cancelled=lambda: False).generation.stop_strings,
                backend.begin(CompletionRequest(kind="text", prompt_text="x", stop=("END",)), on_text=None,
                              cancelled=lambda: False).generation.stop_strings]
        assert seen == [("END",) + tuple(backend.template.stop_strings), ("END",)]
        assert "<end_of_turn>" in seen[0]

    def test_system_option(self):
        """--system is the system prompt of chats that have none; a chat's own system message wins."""
        backend = backend_for(chat="smollm", system="Answer in one word.")
        try:
            template, tokenizer = backend.template, backend.tokenizer
            user = {"role": "user", "content": "Hi"}
            without = CompletionRequest(kind="chat", messages=(user,))
            assert list(backend.prompt(without).tokens) == template.render([user], tokenizer, system="Answer in one word.")
            assert list(backend.prompt(without).tokens) != template.render([user], tokenizer)
            own = CompletionRequest(kind="chat", messages=({"role": "system", "content": "Be long."}, user))
            assert list(backend.prompt(own).tokens) == template.render([{"role": "system", "content": "Be long."}, user], tokenizer)
        finally:
            backend.runtime.close()
