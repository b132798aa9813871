"""The prompt's own log probabilities (Generation's prompt_logprobs: /v1/completions' `echo` with
`logprobs`, what lm-evaluation-harness's loglikelihood tasks read).

Each prompt token after the first is scored under the logits of the position before it. The values
are checked against the numpy reference forward pass (tests/support/reference.py), and bit for bit
against the logprobs the same model reports for the tokens it generates: a greedy reply, fed back as
part of a prompt, must get exactly the values it was generated with, however the prompt is chunked,
alone or beside other generations in the scheduler, and whatever the slot held before.
"""

import numpy as np
import pytest

from krafla_twisted.engine.model import Model
from krafla_twisted.generation.generate import (PROMPT_LOGPROBS_CHUNK, Generation, Runtime, SamplingParams,
                                                run_alone)
from krafla_twisted.generation.scheduler import Scheduler
from tests.support.letters import LetterTokenizer
from tests.support.reference import ReferenceModel
from tests.support.reference_qwen35 import ReferenceQwen35
from tests.support.tiny_models import ARCHS, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35

GREEDY = SamplingParams(temperature=0.0)


def runtime_of(path, parallel=1, batch=16):
    model = Model(path, threads=2)
    return Runtime(model, LetterTokenizer(model.n_vocab), ctx=128, kv="f32", batch=batch, parallel=parallel)


def prompt_of(n_vocab, length, seed=4):
    return [int(t) for t in np.random.default_rng(seed).integers(0, n_vocab, size=length)]


def score(runtime, prompt, top=3, **options):
    generation = Generation(runtime, prompt, sampling=GREEDY, prompt_logprobs=top, reply=False, **options)
    return run_alone(generation)


def log_softmax(rows):
    rows = rows.astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module", params=ARCHS + ("qwen35",))
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model.mlb"
    if request.param == "qwen35":   # linear attention: a slot cannot be cut back, only started over
        return write_tiny_qwen35(path, seed=7, head_dim=32)
    write_tiny_model(path, request.param, seed=7)
    return path


def test_values_are_the_reference_forward_pass(model_path):
    """Entry i is prompt[i + 1]'s log-softmax under the reference's logits at position i, and its
    top alternatives are the reference's best tokens; a prompt longer than a chunk (and than the
    runtime's batch) is scored across the chunk boundaries."""
    runtime = runtime_of(model_path)
    prompt = prompt_of(runtime.model.n_vocab, PROMPT_LOGPROBS_CHUNK + 40)
    result = score(runtime, prompt, top=5)
    model = ReferenceQwen35(model_path) if "qwen35" in str(model_path) else ReferenceModel(model_path)
    reference = log_softmax(model.forward(prompt))
    assert [e.token for e in result.prompt_logprobs] == prompt[1:]
    got = np.array([e.logprob for e in result.prompt_logprobs])
    want = reference[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=2e-3)
    for position, entry in enumerate(result.prompt_logprobs):
        assert [token for token, _ in entry.top] == [int(t) for t in np.argsort(-reference[position], kind="stable")[:5]] \
            or np.ptp(np.sort(reference[position])[-6:]) < 1e-3  # a near tie may order either way
        np.testing.assert_allclose([value for _, value in entry.top], np.sort(reference[position])[::-1][:5], atol=2e-3)


def test_prompt_only_has_no_reply(model_path):
    """reply=False: the prompt is scored and nothing is generated (finish "length", as OpenAI's echo
    with max_tokens 0)."""
    runtime = runtime_of(model_path)
    result = score(runtime, prompt_of(runtime.model.n_vocab, 10))
    assert result.tokens == () and result.text == "" and result.finish_reason == "length"
    assert result.completion_tokens == 0 and result.prompt_tokens == 10 and len(result.prompt_logprobs) == 9


def test_a_reply_scores_as_it_was_generated(model_path):
    """A greedy reply's logprobs, bit for bit, are what the reply gets as part of a prompt: the
    prompt's positions are evaluated by the same batch-invariant forward pass, in chunks of 64."""
    runtime = runtime_of(model_path, batch=64)
    prompt = prompt_of(runtime.model.n_vocab, 30, seed=9)
    reply = run_alone(Generation(runtime, prompt, max_tokens=60, sampling=GREEDY, logprobs=4))
    assert len(reply.tokens) == 60
    scored = score(runtime, prompt + list(reply.tokens), top=4)
    assert scored.prompt_logprobs[len(prompt) - 1:] == reply.logprobs


def test_same_bits_warm_slot_and_scheduler(model_path):
    """A slot that already holds the prompt still evaluates every position (the cached prefix has no
    rows to score); four generations side by side in the scheduler get the values scored alone."""
    runtime = runtime_of(model_path, parallel=4)
    prompts = [prompt_of(runtime.model.n_vocab, n, seed=n) for n in (5, 70, 33, 90)]
    alone = [score(runtime, p).prompt_logprobs for p in prompts]
    assert score(runtime, prompts[1]).prompt_logprobs == alone[1]   # warm: the slot holds this prompt
    assert score(runtime, prompts[1]).cached_tokens == 0
    scheduler = Scheduler(runtime)
    generations = [Generation(runtime, p, sampling=GREEDY, prompt_logprobs=3, max_tokens=5) for p in prompts]
    for generation in generations:
        scheduler.add(generation)
    while scheduler.busy:
        scheduler.step()
    assert [g.result.prompt_logprobs for g in generations] == alone
    assert all(len(g.result.tokens) == 5 for g in generations)
