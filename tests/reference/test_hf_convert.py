"""`krafla convert HF_FOLDER` and the C engine against Hugging Face transformers (issue 7).

Tiny random models are built with transformers (config + seeded weights), saved with
save_pretrained (config.json + model.safetensors, or sharded with an index), converted by
krafla_twisted.convert.hf (our own safetensors reader, no torch) and run by the C engine. The
logits of the last position must match transformers' own forward pass of the same model on the
same token ids: same argmax and cosine >= 0.9999 at f32, for prompts of several lengths and a
batch size that splits the longer prompts into several steps.

Qwen3.5: several shapes, among them the released models' layer pattern (three gated DeltaNet
layers, then one gated full-attention layer), partial RoPE, GQA in both kinds of layer, tied and
untied heads. Quantized files are compared with transformers running the weights the file holds
(dequantized back to float32), so the tolerance measures only what the engine adds: q8_0
activations for the integer dot products. Documented tolerance: median cosine over the prompts
>= 0.995 for q8_0 and >= 0.98 for q4_0 weights (q4_0 weights also meet q8_0 activations).
"""

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from krafla_twisted.convert import quantize
from krafla_twisted.convert.hf import SafetensorsFile, convert_hf
from krafla_twisted.engine import formats
from krafla_twisted.engine.model import Model
from tests.reference.tiny_hf import (assert_engine_matches, cosine, hf_logits, mlb_from_safetensors, prompt,
                                     write_tiny_hf_model)

LENGTHS = (1, 6, 23, 61)
BATCH = 16


def engine_last_logits(path, ids, batch=BATCH):
    with Model(path) as model:
        return model.session(batch=batch).eval(ids).astype(np.float64)


QWEN35_SHAPES = {
    # the released models' pattern: 3 DeltaNet layers, then full attention; rope on a quarter of each head
    "released-pattern": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             tie_word_embeddings=False, partial_rotary_factor=0.25),
    # full attention first, one KV head, value heads == key heads, kernel 3, tied head, half rope
    "mixed-small": dict(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2, hidden_size=32,
                        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=32, linear_conv_kernel_dim=3, tie_word_embeddings=True,
                        partial_rotary_factor=0.5),
    # eight layers from full_attention_interval, three value heads per key head
    "eight-layers": dict(num_hidden_layers=8, hidden_size=48, intermediate_size=64, num_attention_heads=3,
                         num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=3,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         tie_word_embeddings=True, partial_rotary_factor=0.25),
}


def write_tiny_qwen35_hf(folder, *, seed, **shape):
    """A random tiny Qwen3_5ForCausalLM saved to `folder`; returns the model (eval mode)."""
    partial = shape.pop("partial_rotary_factor")
    config = Qwen3_5TextConfig(vocab_size=101, max_position_embeddings=256, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": partial}, **shape)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("A_log"):  # a mild decay, as trained models mostly have
                parameter.copy_(torch.log(0.01 + 0.99 * torch.rand(parameter.shape, generator=generator)))
            elif name.endswith("dt_bias"):
                parameter.copy_(0.5 * noise)
            elif name.endswith("linear_attn.norm.weight"):  # multiplies by w
                parameter.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:  # multiplies by 1 + w
                parameter.copy_(0.1 * noise)
            elif name.endswith("conv1d.weight"):
                parameter.copy_(0.5 * noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))
    model.eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=sorted(QWEN35_SHAPES))
def qwen35(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    model = write_tiny_qwen35_hf(folder / "hf", seed=11, **dict(QWEN35_SHAPES[request.param]))
    mlb, _ = convert_hf(folder / "hf", folder / "model-f32.mlb", None, "f32", progress=False)
    return model, folder, mlb


class Qwen35TransformersTests:
    def test_converted_metadata(self, qwen35):
        """The .mlb holds the layer pattern, partial rope width and DeltaNet sizes of config.json."""
        model, folder, mlb = qwen35
        config = model.config
        meta = formats.read(mlb).metadata
        assert meta["arch"] == "qwen35"
        assert meta["layer_types"] == [2 if t == "linear_attention" else 0 for t in config.layer_types]
        assert meta["rope_dims"] == int(config.head_dim * config.rope_parameters["partial_rotary_factor"])
        assert (meta["linear_k_heads"], meta["linear_v_heads"]) == (config.linear_num_key_heads,
                                                                    config.linear_num_value_heads)
        assert meta["tied_embeddings"] == int(config.tie_word_embeddings)

    @pytest.mark.parametrize("length", LENGTHS)
    def test_f32_logits_match_transformers(self, qwen35, length):
        """Last-position logits: same argmax, cosine >= 0.9999."""
        model, _, mlb = qwen35
        ids = prompt(model.config.vocab_size, length)
        expected, got = hf_logits(model, ids)[-1], engine_last_logits(mlb, ids)
        assert int(np.argmax(got)) == int(np.argmax(expected))
        assert cosine(got, expected) >= 0.9999

    @pytest.mark.parametrize("type_name, floor", [("q8_0", 0.995), ("q4_0", 0.98)])
    def test_quantized_logits_match_transformers_on_the_same_weights(self, qwen35, type_name, floor):
        """A q8_0/q4_0 file against transformers running the weights the file holds: median cosine
        over the prompt lengths >= the documented floor."""
        model, folder, _ = qwen35
        mlb, _ = convert_hf(folder / "hf", folder / f"model-{type_name}.mlb", None, type_name, progress=False)
        container = formats.read(mlb)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if parameter.dim() != 2 or "conv1d" in name:
                    continue
                krafla = _krafla_name(name)
                tensor = container.tensors[krafla]
                if tensor.type.name in ("q8_0", "q4_0"):
                    raw = container.array(krafla).reshape(tensor.shape[0], -1)
                    values = quantize.dequantize(tensor.type.name.upper(), raw, tensor.shape[1])
                    parameter.copy_(torch.from_numpy(np.asarray(values, np.float32)))
        cosines = []
        for length in LENGTHS:
            ids = prompt(model.config.vocab_size, length)
            cosines.append(cosine(engine_last_logits(mlb, ids), hf_logits(model, ids)[-1]))
        # put the f32 weights back for the other tests of this module-scoped model
        model.load_state_dict(_reload(folder / "hf"), strict=False)
        assert np.median(cosines) >= floor, cosines

    def test_numpy_reference_matches_transformers(self, qwen35):
        """tests/support/reference_qwen35.py (the main suite's truth for qwen35) equals
        transformers on every position: same argmax, cosine >= 0.99999."""
        from tests.support.reference_qwen35 import ReferenceQwen35

        model, _, mlb = qwen35
        ids = prompt(model.config.vocab_size, 23)
        expected = hf_logits(model, ids)
        got = ReferenceQwen35(mlb).forward(ids)
        for row_got, row_expected in zip(got, expected):
            assert int(np.argmax(row_got)) == int(np.argmax(row_expected))
            assert cosine(row_got, row_expected) >= 0.99999

    def test_batch_and_single_steps_agree_bitwise(self, qwen35):
        """Prompt processing in batches leaves the same state as token by token: the logits of
        the next token are the same bits."""
        model, _, mlb = qwen35
        ids = prompt(model.config.vocab_size, 40)
        with Model(mlb) as engine:
            one = engine.session(batch=1)
            many = engine.session(batch=40)
            one.eval(ids)
            many.eval(ids)
            assert np.array_equal(one.eval([7]), many.eval([7]))


def _krafla_name(hf_name):
    from krafla_twisted.convert.hf import _LAYER_NAMES
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES['qwen35'][suffix]}"


def _reload(folder):
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
class HuggingFaceFolderTests:
    def test_logits_match_transformers(self, tmp_path, arch):
        """llama, qwen2 and gemma3 folders convert (f32) and the C engine matches transformers:
        same argmax, cosine >= 0.9999, on prompts of several lengths."""
        model = write_tiny_hf_model(tmp_path / "hf", arch, seed=5)
        mlb, _ = convert_hf(tmp_path / "hf", tmp_path / "m.mlb", None, "f32", progress=False)
        assert_engine_matches(mlb, model, LENGTHS, BATCH)

    def test_same_file_content_as_the_reference_mapping(self, tmp_path, arch):
        """The converter's metadata and tensors equal tests/reference/tiny_hf.py's independent
        mapping of the same safetensors (apart from the model name)."""
        write_tiny_hf_model(tmp_path / "hf", arch, seed=6)
        ours = formats.read(convert_hf(tmp_path / "hf", tmp_path / "a.mlb", None, "f32", progress=False)[0])
        theirs = formats.read(mlb_from_safetensors(tmp_path / "hf", tmp_path / "b.mlb"))
        ours.metadata.pop("name"), theirs.metadata.pop("name")
        assert ours.metadata == theirs.metadata
        assert set(ours.tensors) == set(theirs.tensors)
        for name in ours.tensors:
            assert np.array_equal(ours.array(name), theirs.array(name)), name

    def test_sharded_checkpoint(self, tmp_path, arch):
        """A checkpoint saved in shards with model.safetensors.index.json converts to the same file."""
        model = write_tiny_hf_model(tmp_path / "one", arch, seed=7)
        model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
        index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        a = formats.read(convert_hf(tmp_path / "one", tmp_path / "a.mlb", None, "q8_0", progress=False, name="t")[0])
        b = formats.read(convert_hf(tmp_path / "sharded", tmp_path / "b.mlb", None, "q8_0", progress=False, name="t")[0])
        assert a.metadata == b.metadata
        for name in a.tensors:
            assert np.array_equal(a.array(name), b.array(name)), name

    def test_matrices_converted_in_row_chunks_are_the_same(self, tmp_path, arch, monkeypatch):
        """Matrices encoded a few rows at a time (a tiny chunk size) give the same file bytes."""
        write_tiny_hf_model(tmp_path / "hf", arch, seed=8)
        whole = formats.read(convert_hf(tmp_path / "hf", tmp_path / "a.mlb", None, "q4_0", progress=False)[0])
        from krafla_twisted.convert import gguf as gguf_convert
        monkeypatch.setattr(gguf_convert, "_CHUNK_WEIGHTS", 100)
        chunked = formats.read(convert_hf(tmp_path / "hf", tmp_path / "b.mlb", None, "q4_0", progress=False)[0])
        for name in whole.tensors:
            assert np.array_equal(whole.tensors[name].data, chunked.tensors[name].data), name


def test_safetensors_reader_matches_the_safetensors_package(tmp_path):
    """Our reader gives the arrays the safetensors package gives, for f32, f16 and bf16."""
    from safetensors.torch import save_file
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).half(), "c": torch.randn(2, 4).bfloat16()}
    save_file(tensors, tmp_path / "x.safetensors")
    reader = SafetensorsFile(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        assert np.array_equal(reader.get(name), tensor.float().numpy()), name


@pytest.mark.parametrize("name", ["qwen35", "qwen2", "llama-bpe", "gpt-2", "llama-spm"])
def test_test_tokenizer_json_files_are_real_hugging_face_tokenizers(tmp_path, name):
    """The tokenizer.json files tests/test_tokenizer_json.py converts encode llama.cpp's vectors
    with the `tokenizers` library itself, so they stand for real Hugging Face tokenizers."""
    from tokenizers import Tokenizer as HFTokenizer

    from tests.support.hf_tokenizer_json import write_hf_tokenizer
    from tests.support.testdata import vocab_cases, vocab_gguf

    folder = write_hf_tokenizer(vocab_gguf(name), tmp_path, name)
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text, expected in vocab_cases(name):
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected, text


def test_multimodal_checkpoint_converts_its_language_model(tmp_path, capsys):
    """A Qwen3_5ForConditionalGeneration folder (text_config + vision_config, weights under
    model.language_model. and model.visual.): the vision tower is skipped with a message and the
    language model matches transformers' logits."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(3)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(tmp_path / "hf")
    mlb, _ = convert_hf(tmp_path / "hf", tmp_path / "m.mlb", None, "f32", progress=False)
    assert "skipping the vision model" in capsys.readouterr().err
    for length in LENGTHS:
        ids = prompt(101, length)
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
        got = engine_last_logits(mlb, ids)
        assert int(np.argmax(got)) == int(np.argmax(expected))
        assert cosine(got, expected) >= 0.9999


def test_krafla_convert_cli_with_tokenizer_json(tmp_path, capsys):
    """`krafla convert FOLDER` on a tiny Qwen3.5 with the real Qwen3.5 vocabulary's tokenizer.json
    writes a .mlb and .mlt that run together: text encoded by krafla's tokenizer gives the ids
    transformers' tokenizer gives, and the engine's logits on them match transformers'."""
    from transformers import AutoTokenizer

    from krafla_twisted.cli import main
    from krafla_twisted.engine.tokenizer import Tokenizer
    from tests.support.hf_tokenizer_json import write_hf_tokenizer
    from tests.support.testdata import vocab_gguf

    shape = dict(QWEN35_SHAPES["mixed-small"])
    folder = tmp_path / "Tiny-Qwen3.5"
    partial = shape.pop("partial_rotary_factor")
    config = Qwen3_5TextConfig(vocab_size=151936, max_position_embeddings=256, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": partial}, **shape)
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    model.save_pretrained(folder)
    write_hf_tokenizer(vocab_gguf("qwen35"), folder, "qwen35")
    assert main.main(["convert", str(folder), "--type", "f32", "-q"]) == 0
    mlb, mlt = tmp_path / "Tiny-Qwen3.5-F32.mlb", tmp_path / "Tiny-Qwen3.5-F32.mlt"
    assert f"wrote {mlb} and {mlt}" in capsys.readouterr().out
    text = "Hello, Reykjavík! 12 apples cost 3.50 € — ok?"
    ids = Tokenizer(mlt).encode(text, add_bos=False)
    assert ids == AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    got = engine_last_logits(mlb, ids)
    assert int(np.argmax(got)) == int(np.argmax(expected))
    assert cosine(got, expected) >= 0.9999
