"""Tiny random models (tests/support/tiny_models.py) hold exactly what docs/formats.md lists.

The expected keys, tensor names and shapes are parsed from the document's tables, and quantized
weights are checked against gguf-py's reference quantizer, so neither comes from the code under
test.
"""

import math
import pathlib
import re

import gguf
import numpy as np
import pytest
from gguf import quants
from hypothesis import HealthCheck, given, settings

from krafla_twisted.engine import formats
from krafla_twisted.engine.container import ContainerFile
from tests import strategies
from tests.support import tiny_models
from tests.support.tiny_models import write_tiny_model

DOC = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "formats.md").read_text()
GGML_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def doc_section(title):
    start = DOC.index(title)
    end = DOC.find("\n#", start + len(title))
    return DOC[start:end if end >= 0 else len(DOC)]


def doc_metadata_keys(optional=False):
    """Every key named in the first column of the model metadata table (optional=True: only those
    whose description starts "optional", which a file may leave out)."""
    keys = []
    for line in doc_section("### Metadata").splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            if not optional or cells[3].strip().startswith("optional"):
                keys += re.findall(r"`([a-z_]+)`", cells[1])
    return keys


def doc_tensors(metadata, include_optional=False):
    """{name: shape} the document asks of a model with this metadata (with include_optional, also
    the tensors a file may leave out)."""
    arch, tied = metadata["arch"], metadata["tied_embeddings"]
    expected, template_shapes = {}, {}
    for line in doc_section("### Tensors").splitlines():
        if not line.startswith("| `"):
            continue
        names_cell, shape_cell, note = (cell.strip() for cell in line.split("|")[1:4])
        only = re.match(r"([a-z0-9]+(?:, [a-z0-9]+)*)(?::| only)", note)  # "qwen2 only", "gemma3, qwen3: ..."
        if only and only.group(1) != "optional" and arch not in only.group(1).split(", "):
            continue
        if note.startswith("optional") and not include_optional:
            continue
        shape_cell = shape_cell[: shape_cell.index(")") + 1].replace("/", "//")  # "(rope_dims/2,) f32"
        if note.startswith("absent when `tied_embeddings` is 1") and tied:
            continue
        names = re.findall(r"`([^`]+)`", names_cell)
        names = [names[0]] + [names[0].rsplit(".", 2)[0] + n if n.startswith(".") else n for n in names[1:]]
        for name in names:
            if shape_cell == "(rows,)":  # a bias: as long as its matrix has rows
                shape = (template_shapes[name.replace(".bias", ".weight")][0],)
            else:
                shape = eval(shape_cell.replace("·", "*"), {}, dict(metadata))
            template_shapes[name] = shape
            layers = range(metadata["n_layers"]) if "blk.N." in name else [None]
            for layer in layers:
                expected[name.replace("blk.N.", f"blk.{layer}.")] = shape
    return expected


def expected_type(name, metadata, weight_type):
    if name.endswith((".bias", "norm.weight")) or name == "rope_freqs.weight":
        return "f32"
    head = "output.weight" if not metadata["tied_embeddings"] else "token_embd.weight"
    if name == head and weight_type == "q4_0":
        return "q8_0"
    if name == head and weight_type in ("q4_K", "q5_K"):
        return "q6_K"
    return weight_type


class TinyModelLayoutTests:
    @pytest.mark.parametrize("arch", tiny_models.ARCHS)
    @pytest.mark.parametrize("weight_type", tiny_models.WEIGHT_TYPES)
    def test_keys_names_shapes_and_types_follow_the_document(self, tmp_path, arch, weight_type):
        """Every metadata key of docs/formats.md is present (and nothing else), and the tensors are
        exactly the document's names and shapes for the architecture, norms and biases f32, the
        rest in weight_type with a q8_0 head for q4_0 (q6_K for q4_K, q5_K); the C loader reads the
        file the same way."""
        path = tmp_path / "tiny.mlb"
        write_tiny_model(path, arch, seed=0, weight_type=weight_type)
        model = formats.read(path, formats.MODEL_MAGIC)
        assert set(model.metadata) <= set(doc_metadata_keys())
        assert set(doc_metadata_keys()) - set(model.metadata) <= set(doc_metadata_keys(optional=True))
        assert model.metadata["arch"] == arch
        expected = doc_tensors(model.metadata)
        shapes = {name: t.shape for name, t in model.tensors.items()}
        assert set(expected) <= set(shapes)
        assert shapes == {name: shape for name, shape in doc_tensors(model.metadata, True).items() if name in shapes}
        for name, tensor in model.tensors.items():
            assert tensor.type.name == expected_type(name, model.metadata, weight_type), name
        with ContainerFile(path) as loaded:
            assert loaded.metadata == model.metadata
            assert [t[0] for t in loaded.tensors] == list(model.tensors)

    def test_architecture_settings(self, tmp_path):
        """Each architecture carries its distinguishing settings: qwen2 neox RoPE and tied embeddings,
        gemma3 GeGLU, √dim embedding scale, sliding layers in its pattern; llama adjacent-pair RoPE."""
        llama = write_tiny_model(tmp_path / "l.mlb", "llama", seed=0).metadata
        qwen2 = write_tiny_model(tmp_path / "q.mlb", "qwen2", seed=0).metadata
        gemma3 = write_tiny_model(tmp_path / "g.mlb", "gemma3", seed=0, n_layers=6, sliding_window_pattern=3).metadata
        assert (llama["rope_style"], llama["activation"], llama["tied_embeddings"]) == ("norm", "silu", 0)
        assert (qwen2["rope_style"], qwen2["tied_embeddings"]) == ("neox", 1)
        assert gemma3["activation"] == "gelu_tanh" and gemma3["embedding_scale"] == math.sqrt(gemma3["dim"])
        assert gemma3["layer_types"] == [1, 1, 0, 1, 1, 0] and gemma3["sliding_window"] > 0
        assert gemma3["rope_theta_local"] != gemma3["rope_theta"]
        for metadata in (llama, qwen2, gemma3):
            assert metadata["attn_scale"] == 1 / math.sqrt(metadata["head_dim"])
            assert metadata["rope_dims"] == metadata["head_dim"]

    def test_overrides(self, tmp_path):
        """Shape and metadata keywords replace the defaults; output_type sets the head's type."""
        model = write_tiny_model(tmp_path / "m.mlb", "llama", seed=0, weight_type="q4_0", n_vocab=33, dim=32,
                                 n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64, rope_theta=500000.0,
                                 tied_embeddings=1, output_type="f16", name="custom")
        assert model.metadata["n_vocab"] == 33 and model.metadata["rope_theta"] == 500000.0
        assert model.metadata["name"] == "custom" and "output.weight" not in model.tensors
        assert model.tensors["token_embd.weight"].type is formats.F16
        assert model.tensors["blk.0.attn_q.weight"].type is formats.Q4_0

    def test_bad_arguments_are_refused(self, tmp_path):
        """Shapes the format or the quantized types cannot hold, and unknown settings, are refused."""
        path = tmp_path / "m.mlb"
        cases = [
            (dict(arch="mamba"), "not 'mamba'"),
            (dict(weight_type="iq3_s"), "weight_type"),
            (dict(weight_type="q4_0", dim=48), "dim = 48 must be a multiple of 32"),
            (dict(weight_type="q8_0", ffn_dim=40), "ffn_dim = 40"),
            (dict(weight_type="q4_K", dim=128), "dim = 128 must be a multiple of 256"),
            (dict(weight_type="q6_K", n_heads=4, head_dim=32), "n_heads*head_dim = 128 must be a multiple of 256"),
            (dict(n_heads=3, n_kv_heads=2), "not a multiple of n_kv_heads"),
            (dict(head_dim=15), "head_dim 15 must be even"),
            (dict(n_layers=0), "n_layers must be a positive integer"),
            (dict(layer_types=[0]), "1 layer_types for 2 layers"),
            (dict(rope_thetaa=1.0), "unknown settings"),
        ]
        for kwargs, message in cases:
            arguments = dict(arch="llama", seed=0) | kwargs
            with pytest.raises(ValueError, match=re.escape(message)):
                write_tiny_model(path, arguments.pop("arch"), **arguments)


class TinyModelWeightTests:
    def test_same_seed_same_bytes(self, tmp_path):
        """The same arguments give the same file byte for byte; another seed gives other weights."""
        for name in ("a", "b", "c"):
            write_tiny_model(tmp_path / f"{name}.mlb", "gemma3", seed=1 if name != "c" else 2, weight_type="q4_0")
        assert (tmp_path / "a.mlb").read_bytes() == (tmp_path / "b.mlb").read_bytes()
        assert (tmp_path / "a.mlb").read_bytes() != (tmp_path / "c.mlb").read_bytes()

    @pytest.mark.parametrize("weight_type", ["q8_0", "q4_0"])
    def test_quantized_weights_equal_gguf_quantizer(self, tmp_path, weight_type):
        """Each quantized matrix is gguf-py's reference quantization of the f32 model's matrix with
        the same seed, bit for bit, and dequantizes to within half a quantization step of it."""
        f32 = write_tiny_model(tmp_path / "f.mlb", "qwen2", seed=5, dim=96, ffn_dim=160)
        quantized = write_tiny_model(tmp_path / "q.mlb", "qwen2", seed=5, dim=96, ffn_dim=160, weight_type=weight_type)
        for name, tensor in quantized.tensors.items():
            weights = f32.array(name)
            if tensor.type.name == "f32":
                np.testing.assert_array_equal(quantized.array(name), weights)
                continue
            ggml_type = GGML_TYPES[tensor.type.name]
            expected = quants.quantize(weights, ggml_type)
            assert tensor.data.tobytes() == expected.tobytes(), name
            restored = quants.dequantize(tensor.data.reshape(expected.shape), ggml_type)
            step = np.abs(weights).reshape(-1, 32).max(axis=1) / (127 if tensor.type.name == "q8_0" else 7)
            error = np.abs(restored - weights).reshape(-1, 32).max(axis=1)
            assert np.all(error <= step * 1.01 + 1e-7), name

    def test_half_precision_weights(self, tmp_path):
        """f16 and bf16 matrices are the f32 weights rounded to nearest (bf16 checked through
        gguf-py's bf16 dequantizer)."""
        f32 = write_tiny_model(tmp_path / "f.mlb", "llama", seed=9)
        f16 = write_tiny_model(tmp_path / "h.mlb", "llama", seed=9, weight_type="f16")
        bf16 = write_tiny_model(tmp_path / "b.mlb", "llama", seed=9, weight_type="bf16")
        name = "blk.1.ffn_down.weight"
        np.testing.assert_array_equal(f16.array(name), f32.array(name).astype(np.float16))
        restored = quants.dequantize(bf16.tensors[name].data.reshape(f32.array(name).shape[0], -1),
                                     gguf.GGMLQuantizationType.BF16)
        relative = np.abs(restored - f32.array(name)) / np.abs(f32.array(name))
        assert relative.max() <= 2.0**-8

    def test_weights_keep_activations_near_unit_size(self, tmp_path):
        """Matrices have standard deviation near 1/√fan_in and norm weights near 1, so a matrix applied
        to a unit-RMS vector gives a unit-RMS result (the engine's tests rely on sane magnitudes)."""
        model = write_tiny_model(tmp_path / "m.mlb", "llama", seed=4, dim=128, ffn_dim=256)
        for name in model.tensors:
            values = model.array(name)
            if name.endswith("norm.weight"):
                assert abs(values.mean() - 1) < 0.05, name
            else:
                assert abs(values.std() * math.sqrt(values.shape[-1]) - 1) < 0.1, name


class TinyModelStrategyTests:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(args=strategies.tiny_models_args())
    def test_strategy_shapes_make_valid_models(self, tmp_path, args):
        """Every shape the hypothesis strategy draws makes a model that both readers accept with the
        document's tensor shapes."""
        arch, weight_type, kwargs = args
        path = tmp_path / "m.mlb"
        write_tiny_model(path, arch, weight_type=weight_type, **kwargs)
        model = formats.read(path)
        shapes = {name: t.shape for name, t in model.tensors.items()}
        assert set(doc_tensors(model.metadata)) <= set(shapes)
        assert shapes == {name: shape for name, shape in doc_tensors(model.metadata, True).items() if name in shapes}
        with ContainerFile(path) as loaded:
            assert loaded.metadata == model.metadata
