"""The numpy reference against Hugging Face transformers: the independent check of the reference.

Real models: transformers loads each real model's GGUF itself (AutoModelForCausalLM with
gguf_file=..., dequantized to float32 by its own loader) and tokenizes with its own tokenizer
built from the GGUF, so neither side uses krafla's tokenizer; the reference runs the f32 .mlb that
`krafla convert --type f32` made from the same GGUF (tests/support/real_models.py). The last
position's logits must agree: same argmax, cosine >= 0.9999, and no logit further off than
1e-3 of the largest.

Conventions this pins between GGUF, krafla and transformers (the converter and engine rely on
them; each one is exercised by a model below):
- llama (SmolLM2): llama.cpp permuted attn_q/attn_k rows so RoPE rotates adjacent pairs;
  transformers un-permutes them on load and rotates halves. The .mlb keeps GGUF's rows with
  rope_style `norm`, and that equals transformers' neox on the original rows.
- qwen2 / gemma3: rows are not permuted, rope_style `neox`.
- gemma3: GGUF norm weights (all of them, q/k norms included) already hold gemma's 1 + w
  (transformers subtracts 1 on load, adds it back in Gemma3RMSNorm); embeddings scaled by
  sqrt(dim); attention scale query_pre_attn_scalar^-0.5 = 256^-0.5 = 1/sqrt(head_dim); layers
  5, 11, 17 are full attention (rope base 1e6), the others slide over 512 tokens (rope base 1e4,
  a value the GGUF does not hold: both llama.cpp and transformers hard-code it); a query sees
  the keys at distance 0..511. The long prompt below is longer than the window.
- qwen2.5-coder-0.5b: this GGUF has its own output.weight (Q8_0) besides token_embd (Q5_0),
  so the .mlb is not tied, although the Hugging Face model ties them.
- norm_eps: GGUF stores float32 1e-5 (9.99999975e-06); transformers uses that value, the
  converter writes 1e-05. The difference is far below these tolerances.
"""

import gc

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.reference.tiny_hf import cosine, mlb_from_safetensors, write_tiny_hf_model
from tests.support import real_models
from tests.support.reference import ReferenceModel

PROMPTS = {
    "france": "The capital of France is",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "translate": "Translate to German: The weather is nice today.\nGerman:",
    "unicode": "Zürich, Reykjavík and 東京 are cities; 3.14159 × 2 = ",
}
CHAT = [{"role": "user", "content": "What is the largest planet in the solar system?"}]
# The gemma3 GGUF carries no chat template; Gemma 3 turns are Gemma 2's (shared testdata).
TEMPLATE_FALLBACKS = {"gemma3-270m": "google-gemma-2-2b-it.jinja"}
# Longer than gemma3's 512-token window, so the sliding layers drop its beginning.
LONG = " ".join(f"Note {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lamp in room {i * 7 % 13} "
                f"was switched {'on' if i % 3 else 'off'} at {i % 24}:00." for i in range(45))


def assert_logits_match(reference_logits, hf_logits):
    reference_logits = np.asarray(reference_logits, dtype=np.float64)
    hf_logits = np.asarray(hf_logits, dtype=np.float64)
    assert int(np.argmax(reference_logits)) == int(np.argmax(hf_logits))
    assert cosine(reference_logits, hf_logits) >= 0.9999
    assert np.abs(reference_logits - hf_logits).max() <= 1e-3 * np.abs(hf_logits).max()


class RealModel:
    def __init__(self, name):
        gguf = real_models.source_gguf(name)
        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        self.hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        self.hf.eval()
        self.mlb = real_models.real_model(name, "f32").mlb
        self.reference = ReferenceModel(self.mlb)

    def encode(self, text):
        return list(self.tokenizer(text)["input_ids"])

    def hf_last_logits(self, ids):
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.fixture(scope="module", params=real_models.NAMES)
def real(request):
    """One real model at a time, both sides loaded once for all its tests."""
    model = RealModel(request.param)
    yield model
    del model
    gc.collect()


class RealModelTests:
    @pytest.mark.parametrize("prompt", sorted(PROMPTS))
    def test_last_logits_match_transformers(self, real, prompt):
        """The reference's last-position logits on the f32 .mlb equal transformers' on the GGUF."""
        ids = real.encode(PROMPTS[prompt])
        assert_logits_match(real.reference.last_logits(ids), real.hf_last_logits(ids))

    def test_chat_prompt_with_special_tokens(self, real, testdata):
        """A prompt rendered by the model's chat template, special tokens and all, matches."""
        template = None
        if real.tokenizer.chat_template is None:
            template = (testdata / "templates" / TEMPLATE_FALLBACKS[real.name]).read_text()
        text = real.tokenizer.apply_chat_template(CHAT, chat_template=template, add_generation_prompt=True,
                                                  tokenize=False)
        ids = list(real.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert any(i in real.tokenizer.all_special_ids for i in ids)
        assert_logits_match(real.reference.last_logits(ids), real.hf_last_logits(ids))

    def test_greedy_continuation_matches_transformers(self, real):
        """Eight greedy tokens from the reference (through its key/value cache) are the ones
        transformers' generate picks (up to an end-of-sequence it stops at)."""
        ids = real.encode(PROMPTS["story"])
        with torch.no_grad():
            output = real.hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        expected = output[0, len(ids):].tolist()
        assert expected
        assert real.reference.greedy(ids, 8)[:len(expected)] == expected

    def test_long_prompt(self, real):
        """A prompt of over 600 tokens matches transformers. It is longer than gemma3's window,
        and there the window matters: the reference without it is much further from
        transformers than with it."""
        ids = real.encode(LONG)
        assert len(ids) > 576
        hf = real.hf_last_logits(ids)
        ours = real.reference.last_logits(ids)
        assert_logits_match(ours, hf)
        window = real.reference.config.sliding_window
        assert window == (512 if real.name == "gemma3-270m" else 0)
        if window:
            unwindowed = ReferenceModel(real.mlb)
            unwindowed.config.sliding_window = 10 ** 9
            assert np.abs(unwindowed.last_logits(ids) - hf).max() > 20 * np.abs(ours - hf).max()

TINY_CASES = {
    "llama": ("llama", {}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "qwen2": ("qwen2", {}),
    "gemma3": ("gemma3", {}),
    "gemma3-softcap-scaled": ("gemma3", {
        "final_logit_softcapping": 3.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
}


class TinyHuggingFaceModelTests:
    @pytest.mark.parametrize("case", sorted(TINY_CASES))
    def test_every_position_matches_transformers(self, tmp_path, case):
        """A tiny random model saved by transformers (config.json + model.safetensors) and
        written as .mlb gives the same logits at every position under the reference; gemma3's
        window of 4 over 20 tokens, linear RoPE scaling and the final softcap are exercised here
        because the real models do not use them."""
        arch, config = TINY_CASES[case]
        model = write_tiny_hf_model(tmp_path / "hf", arch, seed=7, **config)
        reference = ReferenceModel(mlb_from_safetensors(tmp_path / "hf", tmp_path / "tiny.mlb"))
        ids = np.random.default_rng(3).integers(0, reference.n_vocab, 20).tolist()
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(reference.forward(ids), expected, rtol=1e-4, atol=1e-4)
