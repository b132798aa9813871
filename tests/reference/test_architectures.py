"""Issue 17: Llama 3.1's RoPE scaling, Qwen3, Mistral, Phi-3 and SmolLM3 against transformers.

Tiny random models are built with transformers (several shapes: GQA and multi-head, tied and
untied heads, partial RoPE, SmolLM3's layers without RoPE, Llama 3.1's scaling with an original
context of 32 tokens) and converted two ways:
- from the Hugging Face folder by `krafla_twisted.convert.hf` (vocabulary of 97);
- from a GGUF that llama.cpp's own `convert_hf_to_gguf.py` wrote (fetched from the
  llama-cpp-python source distribution, tests/support/llama_cpp_convert.py), with GPT-2's real
  tokenizer in the folder (vocabulary of 50257), since llama.cpp's converter needs one it knows.
The C engine's last-position logits at f32 must have transformers' argmax and a cosine >= 0.9999,
for prompts of 1 to 100 tokens (longer than the scaled models' original context), and the numpy
reference (tests/support/reference.py, the main suite's truth) must match transformers at every
position. The main suite checks the engine against the reference bit for bit across ISAs on the
tiny qwen3 and smollm3 models of tests/support/tiny_models.py.
"""

import json

import numpy as np
import pytest

from krafla_twisted.convert.gguf import ConvertError, convert_gguf
from krafla_twisted.convert.hf import convert_hf, llama3_rope_factors
from krafla_twisted.engine import formats
from tests.reference.tiny_hf import assert_engine_matches, cosine, hf_logits, prompt, write_tiny_hf_model
from tests.support.hf_tokenizer_json import write_hf_tokenizer
from tests.support.llama_cpp_convert import convert_hf_to_gguf
from tests.support.reference import ReferenceModel
from tests.support.testdata import vocab_gguf

LENGTHS = (1, 23, 61, 100)
LLAMA31 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LLAMA32 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 0.5,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    # name: (transformers arch, config overrides)
    "llama3.1-untied-gqa": ("llama", dict(rope_parameters=LLAMA31, tie_word_embeddings=False)),
    "llama3.2-tied-mha": ("llama", dict(rope_parameters=LLAMA32, tie_word_embeddings=True, num_key_value_heads=4)),
    "qwen3-tied-gqa": ("qwen3", dict(head_dim=16)),
    "qwen3-untied-wide-heads": ("qwen3", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=False)),
    "mistral-untied-gqa": ("mistral", dict()),
    "phi3-untied": ("phi3", dict()),
    "phi3-tied-partial-rope": ("phi3", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5})),
    "smollm3-tied": ("smollm3", dict(num_hidden_layers=4)),
    "smollm3-untied-8-layers": ("smollm3", dict(num_hidden_layers=8, tie_word_embeddings=False)),
}
# Only from a Hugging Face folder: llama.cpp keeps neither Mistral's window (its llama
# architecture has none) nor a SmolLM3 pattern other than every fourth layer.
HF_ONLY_CASES = {
    "mistral-tied-window-8": ("mistral", dict(sliding_window=8, tie_word_embeddings=True)),
    "smollm3-own-pattern": ("smollm3", dict(num_hidden_layers=3, no_rope_layers=[0, 1, 0])),
}


@pytest.fixture(scope="module", params=sorted({**CASES, **HF_ONLY_CASES}))
def from_folder(request, tmp_path_factory):
    """(case, transformers model, f32 .mlb converted from its Hugging Face folder)."""
    arch, config = {**CASES, **HF_ONLY_CASES}[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = write_tiny_hf_model(folder / "hf", arch, seed=17, **config)
    mlb, _ = convert_hf(folder / "hf", folder / "model.mlb", None, "f32", progress=False)
    return request.param, model, mlb


@pytest.fixture(scope="module", params=sorted(CASES))
def from_gguf(request, tmp_path_factory):
    """(case, transformers model, f32 .mlb converted from the GGUF llama.cpp wrote, that GGUF)."""
    arch, config = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param + "-gguf")
    model = write_tiny_hf_model(folder / "hf", arch, seed=19, vocab_size=50257, **config)
    write_hf_tokenizer(vocab_gguf("gpt-2"), folder / "hf", "gpt-2")
    # GPT2Tokenizer: what Phi-4-mini's tokenizer_config names, and what makes transformers (and so
    # llama.cpp's converter) use the GPT-2 tokenizer.json as it is
    config_path = folder / "hf" / "tokenizer_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), tokenizer_class="GPT2Tokenizer")))
    gguf_path = convert_hf_to_gguf(folder / "hf", folder / "model-f32.gguf")
    mlb, _ = convert_gguf(gguf_path, folder / "model.mlb", folder / "model.mlt", "f32", progress=False)
    return request.param, model, mlb, gguf_path


class FromHuggingFaceFolderTests:
    def test_engine_matches_transformers(self, from_folder):
        """The converted folder's last-position logits: transformers' argmax, cosine >= 0.9999,
        on prompts of 1 to 100 tokens."""
        _, model, mlb = from_folder
        assert_engine_matches(mlb, model, LENGTHS)

    def test_reference_matches_transformers_everywhere(self, from_folder):
        """The numpy reference on the same .mlb equals transformers at every position of a
        100-token prompt: same argmax, cosine >= 0.99999."""
        _, model, mlb = from_folder
        ids = prompt(model.config.vocab_size, 100, seed=5)
        expected = hf_logits(model, ids)
        got = ReferenceModel(mlb).forward(ids)
        for row_got, row_expected in zip(got, expected):
            assert int(np.argmax(row_got)) == int(np.argmax(row_expected))
            assert cosine(row_got, row_expected) >= 0.99999

    def test_metadata(self, from_folder):
        """What each architecture puts in the .mlb: the window, the layers without RoPE, the
        rotated width, and Llama 3.1's divisors."""
        case, model, mlb = from_folder
        container = formats.read(mlb)
        meta, config = container.metadata, model.config
        assert meta["arch"] == case.split("-")[0].split(".")[0].replace("llama3", "llama")
        assert meta["tied_embeddings"] == int(config.tie_word_embeddings)
        assert meta["sliding_window"] == (8 if "window" in case else 0)
        assert meta["layer_types"] == [1 if "window" in case else 0] * config.num_hidden_layers
        if case.startswith("smollm3"):
            assert meta["layer_rope"] == list(config.no_rope_layers)
        else:
            assert "layer_rope" not in meta
        partial = (config.rope_parameters or {}).get("partial_rotary_factor") or 1.0
        assert meta["rope_dims"] == int(config.hidden_size // config.num_attention_heads * partial) \
            if case.startswith("phi3") else meta["rope_dims"] == meta["head_dim"]
        assert ("rope_freqs.weight" in container.tensors) == case.startswith("llama")


class FromLlamaCppGGUFTests:
    def test_engine_matches_transformers(self, from_gguf):
        """The GGUF llama.cpp wrote, converted: transformers' argmax, cosine >= 0.9999, on prompts of
        1 to 100 tokens (q/k rows as llama.cpp permuted them, Phi-3's fused matrices split)."""
        _, model, mlb, _ = from_gguf
        assert_engine_matches(mlb, model, LENGTHS)

    def test_rope_divisors_agree_with_llama_cpp(self, from_gguf):
        """Llama 3.1's divisors: llama.cpp's rope_freqs.weight equals ours from config.json
        (float32 rounding apart)."""
        case, model, mlb, _ = from_gguf
        factors = formats.read(mlb).tensors.get("rope_freqs.weight")
        if not case.startswith("llama"):
            assert factors is None
            return
        p = model.config.rope_parameters
        ours = llama3_rope_factors(p["rope_theta"], model.config.head_dim, p["factor"], p["low_freq_factor"],
                                   p["high_freq_factor"], p["original_max_position_embeddings"])
        theirs = formats.read(mlb).array("rope_freqs.weight")
        np.testing.assert_allclose(theirs, ours, rtol=1e-6)
        assert len(set(np.round(ours, 4))) >= 3  # kept, divided by the factor, and blended pairs


class RefusalTests:
    @pytest.mark.parametrize("arch, rope, message", [
        ("phi3", {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                  "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}, "LongRoPE"),
        ("qwen3", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "original_max_position_embeddings": 64}, "YaRN"),
    ])
    def test_refused_rope_scaling_names_itself(self, tmp_path, arch, rope, message):
        """Phi-3.5's LongRoPE and Qwen's YaRN are refused with a message naming them (config.json)."""
        write_tiny_hf_model(tmp_path / "hf", arch, seed=3, rope_parameters=rope)
        with pytest.raises(ConvertError, match=message):
            convert_hf(tmp_path / "hf", tmp_path / "m.mlb", None, "f32", progress=False)
