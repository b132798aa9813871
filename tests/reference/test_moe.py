"""Issue 28: the mixture-of-experts architectures against transformers, live.

Tiny random Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM and GptOssForCausalLM models
(tests/reference/tiny_moe.py; several shapes: experts chosen 1 to 4 of up to 8, renormalised or
not; gpt-oss with YaRN or plain RoPE, windows of 24 or 9, SwiGLU limits of 1.5 or 7) are converted
two ways:
- from the Hugging Face folder by `krafla_twisted.convert.hf` (vocabulary of 97), also from the
  fused expert tensors transformers 5 keeps in memory (`mlp.experts.gate_up_proj`, `down_proj`),
  written to a folder with safetensors;
- from the f32 GGUF that llama.cpp's own `convert_hf_to_gguf.py` wrote (its merged
  ffn_gate_exps/ffn_up_exps/ffn_down_exps and ffn_gate_inp; a Mixtral becomes a llama GGUF with
  experts), with GPT-2's real tokenizer in the folder (vocabulary of 50257);
- gpt-oss also from a folder whose experts are MXFP4 blocks as OpenAI ships them, which llama.cpp's
  converter repacks into an MXFP4 GGUF: the experts stay mxfp4 in the .mlb.
The engine's last-position logits at f32 must have transformers' argmax and a centred cosine
>= 0.9999, for prompts of 1 to 300 tokens. The main suite (tests/test_moe.py) checks the stored
tiny files the same way without torch, and their bits across batches, threads and builds.
"""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from krafla_twisted.convert.gguf import convert_gguf
from krafla_twisted.convert.hf import convert_hf
from krafla_twisted.engine import formats
from krafla_twisted.engine.model import Model
from tests.reference.tiny_moe import prompt, write_tiny_moe
from tests.support.hf_tokenizer_json import write_hf_tokenizer
from tests.support.llama_cpp_convert import convert_hf_to_gguf
from tests.support.testdata import vocab_gguf

LENGTHS = (1, 17, 64, 300)
CASES = {
    "qwen3moe-top2-of-6": ("qwen3moe", dict()),
    "qwen3moe-top1-of-8-tied": ("qwen3moe", dict(num_experts=8, num_experts_per_tok=1, tie_word_embeddings=True,
                                                 num_key_value_heads=1)),
    "qwen3moe-top3-unnormalised": ("qwen3moe", dict(num_experts_per_tok=3, norm_topk_prob=False)),
    "mixtral-top2-of-5": ("mixtral", dict()),
    "mixtral-top2-of-4-mha": ("mixtral", dict(num_local_experts=4, num_key_value_heads=4)),
    "olmoe-top3-of-6": ("olmoe", dict()),
    "olmoe-top2-normalised": ("olmoe", dict(num_experts_per_tok=2, norm_topk_prob=True)),
    "gpt-oss-top2-of-6": ("gpt-oss", dict()),
    "gpt-oss-top4-of-8-mha-limit7": ("gpt-oss", dict(num_local_experts=8, num_experts_per_tok=4, swiglu_limit=7.0,
                                                     num_key_value_heads=4)),
    # three layers with GptOssConfig's own alternation (sliding, full, sliding), RoPE without YaRN
    "gpt-oss-3-layers-window-9": ("gpt-oss", dict(num_hidden_layers=3, layer_types=None, sliding_window=9,
                                                  rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 10000.0})),
}
# One case per architecture (a GGUF with GPT-2's vocabulary is slow to write and read). llama.cpp
# renormalises qwen3moe's weights whatever norm_topk_prob says, as Qwen3-30B-A3B sets it.
# gpt-oss's GGUF has no SwiGLU limit (llama.cpp assumes the released models' 7): its case has 7.
GGUF_CASES = ["qwen3moe-top1-of-8-tied", "mixtral-top2-of-5", "olmoe-top3-of-6", "gpt-oss-top4-of-8-mha-limit7"]
# OpenAI's checkpoints hold the experts as MXFP4: FP4 (e2m1) codes, two a byte (low nibble first),
# with one power-of-two scale byte (exponent + 127) per 32 weights (transformers' FP4_VALUES).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def centred_cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_matches(mlb, model, lengths=LENGTHS, batch=16):
    with Model(mlb, threads=2) as engine:
        for length in lengths:
            ids = prompt(model.config.vocab_size, length)
            with torch.no_grad():
                want = model(torch.tensor([ids])).logits[0, -1].double().numpy()
            got = engine.session(batch=batch).eval(ids)
            assert int(np.argmax(got)) == int(np.argmax(want)), length
            assert centred_cosine(got, want) >= 0.9999, length


@pytest.fixture(scope="module", params=sorted(CASES))
def from_folder(request, tmp_path_factory):
    arch, config = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = write_tiny_moe(folder / "hf", arch, seed=41, **config)
    mlb, _ = convert_hf(folder / "hf", folder / "model.mlb", None, "f32", progress=False)
    return request.param, model, mlb, folder


@pytest.fixture(scope="module", params=GGUF_CASES)
def from_gguf(request, tmp_path_factory):
    arch, config = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param + "-gguf")
    model = write_tiny_moe(folder / "hf", arch, seed=43, **dict(config, vocab_size=50257))
    write_hf_tokenizer(vocab_gguf("gpt-2"), folder / "hf", "gpt-2")
    config_path = folder / "hf" / "tokenizer_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), tokenizer_class="GPT2Tokenizer")))
    gguf_path = convert_hf_to_gguf(folder / "hf", folder / "model-f32.gguf")
    mlb, _ = convert_gguf(gguf_path, folder / "model.mlb", folder / "model.mlt", None, progress=False)
    return request.param, model, mlb


class HuggingFaceFolderTests:
    def test_engine_matches_transformers(self, from_folder):
        """The .mlb converted from the folder gives transformers' argmax and a centred cosine
        >= 0.9999 at the last position, prompts of 1 to 300 tokens."""
        _, model, mlb, _ = from_folder
        assert_matches(mlb, model)

    def test_metadata(self, from_folder):
        """The router's shape and the expert keys come from the config."""
        _, model, mlb, _ = from_folder
        c = model.config
        meta = formats.read(mlb).metadata
        n_experts = getattr(c, "num_experts", None) or c.num_local_experts
        assert (meta["n_experts"], meta["n_experts_used"]) == (n_experts, c.num_experts_per_tok)
        assert meta["expert_weights_norm"] == int(getattr(c, "norm_topk_prob", True))

    def test_fused_expert_tensors(self, from_folder, tmp_path):
        """A checkpoint holding transformers 5's fused experts (gate_up_proj (experts, 2 ffn, dim),
        down_proj) converts to the same bytes as the per-expert one."""
        case, model, mlb, folder = from_folder
        state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()
                 if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
        if case.startswith("mixtral"):
            state = {name.replace(".mlp.", ".block_sparse_moe."): t for name, t in state.items()}
        assert any(name.endswith("experts.gate_up_proj") for name in state)
        fused = tmp_path / "fused"
        fused.mkdir()
        (fused / "config.json").write_text((folder / "hf" / "config.json").read_text())
        save_file(state, fused / "model.safetensors")
        again, _ = convert_hf(fused, tmp_path / "fused.mlb", None, "f32", progress=False)
        want, got = formats.read(mlb), formats.read(again)
        assert sorted(want.tensors) == sorted(got.tensors)
        for name in want.tensors:
            assert np.array_equal(want.tensors[name].data, got.tensors[name].data), name


class LlamaCppGgufTests:
    def test_engine_matches_transformers(self, from_gguf):
        """The .mlb converted from llama.cpp's GGUF (its blocks kept) gives transformers' argmax
        and a centred cosine >= 0.9999, prompts of 1 to 300 tokens."""
        _, model, mlb = from_gguf
        assert_matches(mlb, model)

    def test_architecture(self, from_gguf):
        """llama.cpp's llama-with-experts is mixtral; its q/k rows come permuted (rope_style norm)."""
        case, _, mlb = from_gguf
        meta = formats.read(mlb).metadata
        assert meta["arch"] == CASES[case][0]
        assert meta["rope_style"] == ("norm" if meta["arch"] == "mixtral" else "neox")


def mxfp4_codes(rng, rows, cols):
    """Random MXFP4 blocks (rows, cols / 32, 16) and scales (rows, cols / 32) as OpenAI's
    checkpoints store them, and the weights they stand for (rows, cols) float32: scales of 2^-5
    and 2^-4, so the weights are about unit-preserving for 64 inputs."""
    blocks = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 5, 127 - 3, (rows, cols // 32), dtype=np.uint8)
    values = np.empty((rows, cols // 32, 32), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values *= np.exp2(scales.astype(np.float32) - 127)[..., None]
    return blocks, scales, values.reshape(rows, cols)


@pytest.fixture(scope="module")
def from_mxfp4_gguf(tmp_path_factory):
    """A tiny gpt-oss whose experts are MXFP4 as in OpenAI's folders, through llama.cpp's converter
    (which repacks them into ggml's MXFP4 blocks) and convert_gguf keeping the file's types; the
    transformers model holds the weights the codes stand for."""
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model = write_tiny_moe(folder / "hf", "gpt-oss", seed=47, vocab_size=50257, hidden_size=64, intermediate_size=64,
                           swiglu_limit=7.0)
    c, rng = model.config, np.random.default_rng(47)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    for layer, block in enumerate(model.model.layers):
        experts, prefix = block.mlp.experts, f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * c.intermediate_size, c.hidden_size),
                                 ("down_proj", c.hidden_size, c.intermediate_size)):
            codes = [mxfp4_codes(rng, rows, cols) for _ in range(c.num_local_experts)]
            del state[prefix + name]
            state[prefix + name + "_blocks"] = torch.from_numpy(np.stack([b for b, _, _ in codes]))
            state[prefix + name + "_scales"] = torch.from_numpy(np.stack([s for _, s, _ in codes]))
            with torch.no_grad():  # transformers keeps them transposed, (experts, inputs, outputs)
                getattr(experts, name).copy_(torch.from_numpy(np.stack([v.T for _, _, v in codes])))
    (folder / "hf" / "model.safetensors").unlink()
    save_file(state, folder / "hf" / "model.safetensors")
    config_path = folder / "hf" / "config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()),
                                           quantization_config={"quant_method": "mxfp4"})))
    write_hf_tokenizer(vocab_gguf("gpt-2"), folder / "hf", "gpt-2")
    tokenizer_config = folder / "hf" / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps(dict(json.loads(tokenizer_config.read_text()),
                                                tokenizer_class="GPT2Tokenizer")))
    gguf_path = convert_hf_to_gguf(folder / "hf", folder / "model-mxfp4.gguf")
    mlb, _ = convert_gguf(gguf_path, folder / "model.mlb", folder / "model.mlt", None, progress=False)
    return model, mlb


class GptOssMxfp4Tests:
    def test_experts_kept_as_mxfp4(self, from_mxfp4_gguf):
        """The GGUF's MXFP4 experts are copied as they are (type mxfp4 in the .mlb), the router and
        the biases f32."""
        _, mlb = from_mxfp4_gguf
        tensors = formats.read(mlb).tensors
        for layer in range(2):
            for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                assert tensors[f"blk.{layer}.{name}.weight"].type is formats.MXFP4, name
                assert tensors[f"blk.{layer}.{name}.bias"].type is formats.F32, name
            assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].type is formats.F32

    def test_engine_matches_transformers(self, from_mxfp4_gguf):
        """With the MXFP4 experts (multiplied with q8 activations), the engine's logits have a
        centred cosine >= 0.9995 with transformers' on the weights the codes stand for, and its
        argmax is transformers' or a near-tie of it (within 0.01 of the top logit: the activations'
        rounding moves logits by about that), prompts of 1 to 300 tokens."""
        model, mlb = from_mxfp4_gguf
        with Model(mlb, threads=2) as engine:
            for length in LENGTHS:
                ids = prompt(model.config.vocab_size, length)
                with torch.no_grad():
                    want = model(torch.tensor([ids])).logits[0, -1].double().numpy()
                got = engine.session(batch=16).eval(ids)
                assert want[int(np.argmax(got))] >= want.max() - 0.01, length
                assert centred_cosine(got, want) >= 0.9995, length
