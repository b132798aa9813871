"""`krafla convert`: GGUF -> .mlb/.mlt, checked on the three real models and on tiny GGUFs.

The independent checks: hyperparameters against the models' published configs (MODELS.md and
the Hugging Face config.json values written out below), weights against gguf-py's own
dequantize -> quantize pipeline, and the written files through the C loader.
"""

import math

import gguf
import numpy as np
import pytest

from krafla_twisted.cli import convert as convert_cli
from krafla_twisted.convert.gguf import ConvertError, convert_gguf, hyperparameters, model_base_name, output_names
from krafla_twisted.engine import formats
from krafla_twisted.engine.container import ContainerFile
from tests.support.real_models import gguf_reader, real_model, source_gguf

GGML = gguf.GGMLQuantizationType

# From each model's config.json (Hugging Face) and MODELS.md.
EXPECTED_METADATA = {
    "smollm2-135m": dict(
        name="SmolLM2-135M-Instruct", arch="llama", n_vocab=49152, dim=576, n_layers=30, n_heads=9,
        n_kv_heads=3, head_dim=64, ffn_dim=1536, max_seq=8192, norm_eps=1e-5, rope_theta=100000.0,
        rope_theta_local=100000.0, rope_scale=1.0, rope_style="norm", rope_dims=64, activation="silu",
        tied_embeddings=1, embedding_scale=1.0, attn_scale=1 / 8, sliding_window=0, layer_types=[0] * 30,
        attn_softcap=0.0, final_softcap=0.0, file_type="Q4_0"),
    "qwen2.5-coder-0.5b": dict(
        name="Qwen2.5-Coder-0.5B-Instruct", arch="qwen2", n_vocab=151936, dim=896, n_layers=24, n_heads=14,
        n_kv_heads=2, head_dim=64, ffn_dim=4864, max_seq=32768, norm_eps=1e-6, rope_theta=1000000.0,
        rope_theta_local=1000000.0, rope_scale=1.0, rope_style="neox", rope_dims=64, activation="silu",
        # Qwen2.5-0.5B ties its head in config.json, but this GGUF carries output.weight (Q8_0).
        tied_embeddings=0, embedding_scale=1.0, attn_scale=1 / 8, sliding_window=0, layer_types=[0] * 24,
        attn_softcap=0.0, final_softcap=0.0, file_type="Q4_0"),
    "gemma3-270m": dict(
        name="gemma-3-270m", arch="gemma3", n_vocab=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1,
        head_dim=256, ffn_dim=2048, max_seq=32768, norm_eps=1e-6, rope_theta=1000000.0,
        rope_theta_local=10000.0, rope_scale=1.0, rope_style="neox", rope_dims=256, activation="gelu_tanh",
        tied_embeddings=1, embedding_scale=math.sqrt(640), attn_scale=256 ** -0.5,  # query_pre_attn_scalar 256
        sliding_window=512,
        # config.json layer_types: five sliding_attention layers, then one full_attention, three times.
        layer_types=[1, 1, 1, 1, 1, 0] * 3,
        attn_softcap=0.0, final_softcap=0.0, file_type="Q4_0"),
}

LAYER_TENSORS = {
    "llama": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
}
LAYER_TENSORS["qwen2"] = LAYER_TENSORS["llama"] + ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
LAYER_TENSORS["gemma3"] = LAYER_TENSORS["llama"] + ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]


def expected_names(meta):
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not meta["tied_embeddings"] else set())
    for layer in range(meta["n_layers"]):
        for tensor in LAYER_TENSORS[meta["arch"]]:
            names.add(f"blk.{layer}.{tensor}" + ("" if tensor.endswith(".bias") else ".weight"))
    return names


def gguf_tensors(name):
    return {t.name: t for t in gguf_reader(name).tensors}


SAMPLE_ROWS = 1024


def sample_rows(array):
    """The first and last SAMPLE_ROWS rows of a big matrix (rows are encoded independently)."""
    if array.ndim == 2 and array.shape[0] > 2 * SAMPLE_ROWS:
        return np.concatenate([array[:SAMPLE_ROWS], array[-SAMPLE_ROWS:]])
    return array


def gguf_encoded(tensor, type_name):
    """What the converter must write for `tensor` as `type_name` (sampled rows), computed with gguf-py alone."""
    raw = np.asarray(tensor.data)
    raw = sample_rows(raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw.reshape(1, -1))
    values = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(raw.shape[0], -1).astype(np.float32)
    if type_name == "f32":
        return values.view(np.uint8)
    if type_name == "f16":
        return values.astype("<f2").view(np.uint8)
    return gguf.quants.quantize(values, GGML[type_name.upper()])


def stored_rows(tensor):
    """The same sampled rows of a converted tensor's bytes."""
    return sample_rows(tensor.data.reshape(tensor.shape[0] if len(tensor.shape) > 1 else 1, -1))


@pytest.mark.parametrize("name", sorted(EXPECTED_METADATA))
class RealModelTests:
    """The pulled q4_0 files of the three real models."""

    def test_metadata_matches_the_published_config(self, name):
        """Every metadata key of the .mlb has the value the model's config gives."""
        container = formats.read(real_model(name).mlb)
        expected = EXPECTED_METADATA[name]
        assert set(container.metadata) == set(expected)
        for key, value in expected.items():
            if isinstance(value, float):
                assert container.metadata[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert container.metadata[key] == value, key

    def test_tensor_table_types_and_shapes(self, name):
        """The model's tensors, all of them: q4_0 matrices, q8_0 head (or tied embedding), f32 vectors,
        shapes as (outputs, inputs); the C loader reads the same table."""
        pulled = real_model(name)
        container = formats.read(pulled.mlb)
        meta = container.metadata
        assert set(container.tensors) == expected_names(meta)
        head = "token_embd.weight" if meta["tied_embeddings"] else "output.weight"
        for tensor in container.tensors.values():
            if len(tensor.shape) == 1:
                assert tensor.type is formats.F32, tensor.name
            elif tensor.name == head:
                assert tensor.type is formats.Q8_0, tensor.name
            else:
                assert tensor.type is formats.Q4_0, tensor.name
        q_rows, kv_rows = meta["n_heads"] * meta["head_dim"], meta["n_kv_heads"] * meta["head_dim"]
        assert container.tensors["token_embd.weight"].shape == (meta["n_vocab"], meta["dim"])
        assert container.tensors["blk.0.attn_q.weight"].shape == (q_rows, meta["dim"])
        assert container.tensors["blk.0.attn_k.weight"].shape == (kv_rows, meta["dim"])
        assert container.tensors["blk.0.attn_output.weight"].shape == (meta["dim"], q_rows)
        assert container.tensors["blk.0.ffn_down.weight"].shape == (meta["dim"], meta["ffn_dim"])
        with ContainerFile(str(pulled.mlb)) as loaded:
            assert [(n, t, tuple(s)) for n, t, s, _ in loaded.tensors] == \
                [(t.name, t.type.name, t.shape) for t in container.tensors.values()]

    def test_weights_equal_gguf_py_requantized(self, name):
        """Layer 0, the last layer, the embedding and the head hold exactly the blocks gguf-py's
        dequantize -> quantize gives (matrices of over 2048 rows: their first and last 1024 rows);
        vectors are the GGUF's f32 values (gemma3's norms already hold the + 1, so they are
        copied, not shifted)."""
        container = formats.read(real_model(name).mlb)
        sources = gguf_tensors(name)
        last = container.metadata["n_layers"] - 1
        checked = [n for n in container.tensors
                   if not n.startswith("blk.") or n.startswith(("blk.0.", f"blk.{last}."))]
        for tensor_name in checked:
            tensor = container.tensors[tensor_name]
            expected = gguf_encoded(sources[tensor_name], tensor.type.name)
            assert np.array_equal(stored_rows(tensor), expected), tensor_name


class OtherTypesTests:
    """--type f32, f16 and q8_0 on SmolLM2 (the small model)."""

    @pytest.mark.parametrize("type_name", ["f32", "f16", "q8_0"])
    def test_every_tensor_matches_gguf_py(self, type_name):
        """Every tensor is gguf-py's dequantized value encoded as the type (vectors stay f32;
        matrices of over 2048 rows are compared on their first and last 1024 rows)."""
        container = formats.read(real_model("smollm2-135m", type_name).mlb)
        sources = gguf_tensors("smollm2-135m")
        assert set(container.tensors) == set(sources)
        for tensor in container.tensors.values():
            wanted = "f32" if len(tensor.shape) == 1 else type_name
            assert tensor.type.name == wanted, tensor.name
            assert np.array_equal(stored_rows(tensor), gguf_encoded(sources[tensor.name], wanted)), tensor.name

    def test_q4_0_keeps_output_at_q8_0_when_untied(self, tmp_path):
        """With a separate output.weight (Qwen2.5's GGUF), the embedding is q4_0 and the head q8_0."""
        container = formats.read(real_model("qwen2.5-coder-0.5b").mlb)
        assert container.tensors["token_embd.weight"].type is formats.Q4_0
        assert container.tensors["output.weight"].type is formats.Q8_0


class CommandTests:
    """`krafla convert` on the command line."""

    def test_convert_names_outputs_like_the_original(self, tmp_path, capsys):
        """Without -o/-z the files are NAME-TYPE.mlb/.mlt beside the source; the name metadata is NAME."""
        source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
        source.symlink_to(source_gguf("smollm2-135m"))
        parser = _parser()
        status = convert_cli.main(parser.parse_args([str(source), "--type", "q8_0", "-q"]))
        assert status == 0
        mlb, mlt = tmp_path / "SmolLM2-135M-Instruct-Q8_0.mlb", tmp_path / "SmolLM2-135M-Instruct-Q8_0.mlt"
        assert f"wrote {mlb} and {mlt}" in capsys.readouterr().out
        assert formats.read(mlb).metadata["name"] == "SmolLM2-135M-Instruct"
        assert formats.read(mlt).magic == formats.TOKENIZER_MAGIC

    def test_krafla_command_dispatches_to_convert(self, tmp_path, capsys):
        """`krafla convert` reaches this module through the top-level command."""
        from krafla_twisted.cli import main

        assert main.main(["convert", str(tmp_path)]) == 1
        assert "no config.json" in capsys.readouterr().err

    def test_directory_is_read_as_hugging_face_folder(self, tmp_path, capsys):
        """A folder goes to the Hugging Face converter (status 1 naming config.json when it has none);
        convert_gguf itself refuses a folder."""
        status = convert_cli.main(_parser().parse_args([str(tmp_path), "-o", str(tmp_path / "x.mlb")]))
        assert status == 1
        assert "no config.json" in capsys.readouterr().err
        with pytest.raises(ConvertError, match="is a directory"):
            convert_gguf(tmp_path, tmp_path / "x.mlb", tmp_path / "x.mlt")

    def test_bad_files_give_one_line_errors(self, tmp_path, capsys):
        """A missing file or a file that is not GGUF: status 1 and the path in the message."""
        garbage = tmp_path / "garbage.gguf"
        garbage.write_bytes(b"not a gguf file at all" * 10)
        for path, message in ((tmp_path / "absent.gguf", "no such file"), (garbage, "not a readable GGUF")):
            status = convert_cli.main(_parser().parse_args([str(path), "-o", str(tmp_path / "x.mlb"), "-q"]))
            err = capsys.readouterr().err
            assert status == 1 and str(path) in err and message in err
            assert not (tmp_path / "x.mlb").exists()

    @pytest.mark.parametrize("source, base", [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m"),
        ("Qwen2.5-0.5B-Instruct-f16.gguf", "Qwen2.5-0.5B-Instruct"),
        ("tinyllama-1.1b-chat-v1.0.Q8_0.gguf", "tinyllama-1.1b-chat-v1.0"),
        ("model.gguf", "model"),
    ])
    def test_base_names(self, source, base):
        """The quantization label at the end of a GGUF name is dropped and the new type appended."""
        assert model_base_name(source) == base
        assert output_names(f"/x/{source}", "q4_0")[0].name == f"{base}-Q4_0.mlb"


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    convert_cli.add_arguments(parser)
    return parser


# ------------------------------------------------------------------------------------------
# Tiny GGUFs written with gguf-py's writer, for the refusals.

# Where each block type keeps its f16 scale(s), in bytes of a block (ggml-common.h's layouts).
SCALE_BYTES = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q3_K": (108, 110), "Q2_K": (80, 84),
               "IQ4_NL": (0, 2), "IQ4_XS": (0, 2), "IQ3_S": (0, 2), "IQ2_XXS": (0, 2)}


def write_gguf(path, arch="llama", *, drop=(), extra=None, kv=None, raw=None, encode=None, n_layers=1, values=None,
               dim=32, head_dim_keys=True):
    """A minimal GGUF of `arch` (2 heads of 16, 1 kv head, vocab 8), with tensors left out,
    added, given values, quantized by gguf-py (`encode`: name -> GGML type) or replaced by random
    bytes of a GGML type with finite scales (`raw`: name -> type)."""
    ffn, n_vocab, head_dim = 64, 8, 16
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", n_layers)
    writer.add_uint32(f"{arch}.embedding_length", dim)
    writer.add_uint32(f"{arch}.feed_forward_length", ffn)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    writer.add_uint32(f"{arch}.context_length", 64)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if head_dim_keys:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", 4)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    # A SentencePiece vocabulary of 8 tokens.
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "\u2581a", "\u2581b"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0])
    writer.add_array("tokenizer.ggml.token_type", [2, 3, 3, 1, 1, 1, 1, 1])
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (n_vocab, dim), "output_norm.weight": (dim,)}
    for layer in range(n_layers):
        shapes.update({f"blk.{layer}.attn_norm.weight": (dim,), f"blk.{layer}.attn_q.weight": (2 * head_dim, dim),
                       f"blk.{layer}.attn_k.weight": (head_dim, dim), f"blk.{layer}.attn_v.weight": (head_dim, dim),
                       f"blk.{layer}.attn_output.weight": (dim, 2 * head_dim), f"blk.{layer}.ffn_norm.weight": (dim,),
                       f"blk.{layer}.ffn_gate.weight": (ffn, dim), f"blk.{layer}.ffn_up.weight": (ffn, dim),
                       f"blk.{layer}.ffn_down.weight": (dim, ffn)})
        if arch == "gemma3":
            shapes.update({f"blk.{layer}.attn_q_norm.weight": (head_dim,), f"blk.{layer}.attn_k_norm.weight": (head_dim,),
                           f"blk.{layer}.post_attention_norm.weight": (dim,),
                           f"blk.{layer}.post_ffw_norm.weight": (dim,)})
    shapes.update(extra or {})
    for name, shape in shapes.items():
        if name in drop:
            continue
        data = (values or {}).get(name, rng.standard_normal(shape).astype(np.float32))
        type_name = (raw or {}).get(name)
        if type_name:
            block, block_bytes = gguf.GGML_QUANT_SIZES[GGML[type_name]]
            encoded = rng.integers(0, 256, (shape[0], shape[1] // block * block_bytes), dtype=np.uint8)
            if type_name in SCALE_BYTES:  # finite f16 scales (d, dmin) where ggml's layout keeps them
                begin, end = SCALE_BYTES[type_name]
                scales = rng.uniform(0.001, 0.01, (encoded.size // block_bytes, (end - begin) // 2)).astype("<f2")
                encoded.reshape(-1, block_bytes)[:, begin:end] = scales.view(np.uint8)
            writer.add_tensor(name, encoded, raw_dtype=GGML[type_name])
        elif (encode or {}).get(name):
            writer.add_tensor(name, gguf.quants.quantize(data, GGML[encode[name]]), raw_dtype=GGML[encode[name]])
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class RefusalTests:
    """What the converter will not convert, and the message it gives."""

    def convert(self, tmp_path, source):
        return convert_gguf(source, tmp_path / "out.mlb", tmp_path / "out.mlt", progress=False)

    def test_unknown_architecture_names_itself_and_the_supported_ones(self, tmp_path):
        """An architecture without a mapping is refused, naming it and llama, qwen2, gemma3."""
        source = write_gguf(tmp_path / "m.gguf", "mamba")
        with pytest.raises(ConvertError, match=r"architecture 'mamba' is not supported.*llama, qwen2, gemma3"):
            self.convert(tmp_path, source)
        assert not (tmp_path / "out.mlb").exists()

    def test_missing_tensor_is_named(self, tmp_path):
        """A model without blk.0.ffn_up.weight is refused, naming the tensor."""
        source = write_gguf(tmp_path / "m.gguf", drop={"blk.0.ffn_up.weight"})
        with pytest.raises(ConvertError, match=r"lacks tensors blk\.0\.ffn_up\.weight"):
            self.convert(tmp_path, source)

    def test_qwen2_without_biases_is_refused(self, tmp_path):
        """qwen2 needs q/k/v biases: a llama-shaped file labelled qwen2 names them missing."""
        source = write_gguf(tmp_path / "m.gguf", "qwen2")
        with pytest.raises(ConvertError, match=r"attn_q\.bias"):
            self.convert(tmp_path, source)

    def test_unknown_tensor_is_named(self, tmp_path):
        """A tensor krafla has no use for (a mixture of experts' router) is refused rather than dropped."""
        source = write_gguf(tmp_path / "m.gguf", extra={"blk.0.ffn_gate_inp.weight": (4, 32)})
        with pytest.raises(ConvertError, match=r"does not know for llama: blk\.0\.ffn_gate_inp\.weight"):
            self.convert(tmp_path, source)

    def test_missing_hyperparameter_is_named(self, tmp_path):
        """Without llama.feed_forward_length the message names the key and what it means."""
        source = write_gguf(tmp_path / "m.gguf")
        reader = gguf.GGUFReader(source)
        del reader.fields["llama.feed_forward_length"]
        with pytest.raises(ConvertError, match=r"llama\.feed_forward_length \(MLP width\) is missing"):
            hyperparameters(reader, source)

    def test_shape_disagreeing_with_hyperparameters(self, tmp_path):
        """attn_k with 2 heads' rows where head_count_kv says 1: refused with both shapes."""
        source = write_gguf(tmp_path / "m.gguf", extra={"blk.0.attn_k.weight": (32, 32)})
        with pytest.raises(ConvertError, match=r"blk\.0\.attn_k\.weight has shape \(32, 32\), expected \(16, 32\)"):
            self.convert(tmp_path, source)

    def test_unsupported_tensor_type_is_named(self, tmp_path):
        """An IQ3_S tensor: refused naming the tensor, its type, the types kept and the --type to use."""
        source = write_gguf(tmp_path / "m.gguf", dim=256, raw={"blk.0.ffn_gate.weight": "IQ3_S"})
        with pytest.raises(ConvertError, match=r"blk\.0\.ffn_gate\.weight has type IQ3_S, which krafla does not "
                                               r"compute on \(it keeps .*Q4_K.*\); convert with --type q8_0"):
            self.convert(tmp_path, source)

    def test_non_finite_weights_are_refused(self, tmp_path):
        """A NaN weight is an error naming the tensor, not a silently broken model."""
        bad = np.ones((64, 32), np.float32)
        bad[3, 4] = np.nan
        source = write_gguf(tmp_path / "m.gguf", values={"blk.0.ffn_up.weight": bad})
        with pytest.raises(ConvertError, match=r"blk\.0\.ffn_up\.weight holds NaN"):
            self.convert(tmp_path, source)

    def test_missing_output_directory_is_refused_before_any_work(self, tmp_path):
        """An output in a folder that does not exist is an error naming the folder, even for a bad source."""
        with pytest.raises(ConvertError, match=r"directory .*/absent does not exist"):
            convert_gguf(tmp_path / "m.gguf", tmp_path / "absent" / "o.mlb", tmp_path / "o.mlt")

    def test_bad_type_name(self, tmp_path):
        """--type q2_k is refused listing the types krafla writes."""
        with pytest.raises(ConvertError, match="f32, f16, q8_0, q4_0"):
            convert_gguf(tmp_path / "m.gguf", tmp_path / "o.mlb", tmp_path / "o.mlt", "q2_k")


class HyperparameterTests:
    """Mapping GGUF keys to .mlb metadata on tiny files."""

    def test_gemma3_default_pattern_every_sixth_layer_is_global(self, tmp_path):
        """Without a pattern key, gemma3 layer i is full attention when (i + 1) % 6 == 0."""
        source = write_gguf(tmp_path / "g.gguf", "gemma3", n_layers=12)
        meta = hyperparameters(gguf.GGUFReader(source), source)
        assert meta["layer_types"] == [1, 1, 1, 1, 1, 0] * 2
        assert meta["sliding_window"] == 4 and meta["rope_theta_local"] == 10000.0
        assert meta["embedding_scale"] == pytest.approx(math.sqrt(32))
        assert meta["attn_scale"] == pytest.approx(16 ** -0.5)
        assert meta["activation"] == "gelu_tanh" and meta["rope_style"] == "neox"

    def test_gemma3_pattern_key_wins(self, tmp_path):
        """gemma3.attention.sliding_window_pattern (a period, or one flag per layer) overrides the default."""
        source = write_gguf(tmp_path / "g.gguf", "gemma3", n_layers=4, kv={"gemma3.attention.sliding_window_pattern": 2})
        assert hyperparameters(gguf.GGUFReader(source), source)["layer_types"] == [1, 0, 1, 0]
        flags = [True, False, False, True]
        source = write_gguf(tmp_path / "h.gguf", "gemma3", n_layers=4, kv={"gemma3.attention.sliding_window_pattern": flags})
        assert hyperparameters(gguf.GGUFReader(source), source)["layer_types"] == [1, 0, 0, 1]

    def test_rope_scaling_and_attention_scale_keys(self, tmp_path):
        """rope.scaling linear/factor and attention.scale are read when present; yarn is refused."""
        kv = {"llama.rope.scaling.factor": 8.0, "llama.attention.scale": 0.5, "llama.rope.freq_base": 500000.0}
        source = write_gguf(tmp_path / "a.gguf", kv=kv)
        meta = hyperparameters(gguf.GGUFReader(source), source)
        assert meta["rope_scale"] == 1.0  # a factor without a scaling type is not applied
        assert meta["attn_scale"] == 0.5 and meta["rope_theta"] == 500000.0 and meta["rope_style"] == "norm"
        source = write_gguf(tmp_path / "b.gguf", kv={**kv, "llama.rope.scaling.type": "linear"})
        assert hyperparameters(gguf.GGUFReader(source), source)["rope_scale"] == 8.0
        source = write_gguf(tmp_path / "c.gguf", kv={**kv, "llama.rope.scaling.type": "yarn"})
        with pytest.raises(ConvertError, match="RoPE scaling 'yarn' is not supported"):
            hyperparameters(gguf.GGUFReader(source), source)

    def test_llama_defaults(self, tmp_path):
        """Without key_length, rope base or dimension count: head_dim = dim / heads, base 10000,
        all dimensions rotated, 1/sqrt(head_dim) attention scale, no sliding window."""
        source = write_gguf(tmp_path / "d.gguf", n_layers=2, head_dim_keys=False)
        meta = hyperparameters(gguf.GGUFReader(source), source)
        assert (meta["head_dim"], meta["rope_dims"], meta["rope_theta"]) == (16, 16, 10000.0)
        assert meta["attn_scale"] == 0.25 and meta["layer_types"] == [0, 0] and meta["sliding_window"] == 0
        assert meta["norm_eps"] == 1e-5 and meta["embedding_scale"] == 1.0


class TinyConversionTests:
    """End to end on tiny f32 GGUFs, where the expected blocks are gguf-py's quantization of known floats."""

    @pytest.mark.parametrize("type_name", ["f32", "f16", "q8_0", "q4_0"])
    def test_tied_llama(self, tmp_path, type_name):
        """Matrices become `type_name` (the tied embedding q8_0 under q4_0), vectors stay f32 and
        equal the source; both files open in the C loader."""
        rng = np.random.default_rng(1)
        values = {"blk.0.ffn_up.weight": rng.standard_normal((64, 32)).astype(np.float32),
                  "token_embd.weight": rng.standard_normal((8, 32)).astype(np.float32),
                  "blk.0.attn_norm.weight": rng.standard_normal(32).astype(np.float32)}
        source = write_gguf(tmp_path / "tiny.gguf", values=values)
        mlb, mlt = convert_gguf(source, tmp_path / "tiny.mlb", tmp_path / "tiny.mlt", type_name, progress=False)
        model = formats.read(mlb)
        assert model.metadata["tied_embeddings"] == 1 and model.metadata["name"] == "tiny"
        assert model.metadata["file_type"] == type_name.upper()
        embedding_type = "q8_0" if type_name == "q4_0" else type_name
        for name, wanted in (("blk.0.ffn_up.weight", type_name), ("token_embd.weight", embedding_type)):
            assert model.tensors[name].type.name == wanted
            if wanted == "f32":
                expected = values[name].view(np.uint8).reshape(-1)
            elif wanted == "f16":
                expected = values[name].astype("<f2").view(np.uint8).reshape(-1)
            else:
                expected = gguf.quants.quantize(values[name], GGML[wanted.upper()]).reshape(-1)
            assert np.array_equal(model.tensors[name].data, expected), name
        np.testing.assert_array_equal(model.array("blk.0.attn_norm.weight"), values["blk.0.attn_norm.weight"])
        with ContainerFile(str(mlb)) as loaded:
            assert len(loaded.tensors) == len(model.tensors)
        with ContainerFile(str(mlt)) as loaded:
            assert loaded.magic == formats.TOKENIZER_MAGIC

    @pytest.mark.parametrize("file_type, label", [(15, "Q4_K_M"), (0, "F32"), (7, "Q8_0"), (1024, None), (None, None)])
    def test_file_type_of_a_kept_conversion(self, tmp_path, file_type, label):
        """Without --type, `file_type` is the GGUF's general.file_type by llama.cpp's name (15 is
        MOSTLY_Q4_K_M), and absent when the GGUF gives none or only "guessed" (1024)."""
        kv = {} if file_type is None else {"general.file_type": file_type}
        source = write_gguf(tmp_path / "kept.gguf", kv=kv)
        model = formats.read(convert_gguf(source, tmp_path / "k.mlb", tmp_path / "k.mlt", progress=False)[0])
        assert model.metadata.get("file_type") == label

    def test_separate_head_under_q4_0(self, tmp_path):
        """With output.weight present: embedding q4_0, head q8_0, tied_embeddings 0."""
        source = write_gguf(tmp_path / "head.gguf", extra={"output.weight": (8, 32)})
        model = formats.read(convert_gguf(source, tmp_path / "h.mlb", tmp_path / "h.mlt", "q4_0", progress=False)[0])
        assert model.metadata["tied_embeddings"] == 0
        assert model.tensors["token_embd.weight"].type is formats.Q4_0
        assert model.tensors["output.weight"].type is formats.Q8_0

    def test_gemma3_norms_are_copied(self, tmp_path):
        """gemma3 GGUF norms already hold llama.cpp's + 1: the .mlb has the same values, not + 1 again."""
        norm = np.linspace(0.5, 2.0, 16, dtype=np.float32)
        source = write_gguf(tmp_path / "g.gguf", "gemma3", values={"blk.0.attn_q_norm.weight": norm})
        model = formats.read(convert_gguf(source, tmp_path / "g.mlb", tmp_path / "g.mlt", progress=False)[0])
        np.testing.assert_array_equal(model.array("blk.0.attn_q_norm.weight"), norm)
        assert model.metadata["layer_types"] == [1]

    def test_phi3_fused_matrices_are_split_by_rows(self, tmp_path):
        """phi3's attn_qkv (q, k, v rows) and double-height ffn_up (gate rows, then up) become
        attn_q/k/v and ffn_gate/up holding exactly those rows; a window makes every layer slide."""
        rng = np.random.default_rng(2)
        qkv, up = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((128, 32)).astype(np.float32)
        source = write_gguf(tmp_path / "p.gguf", "phi3", n_layers=2,
                            drop=[f"blk.{i}.{n}" for i in range(2) for n in ("attn_q.weight", "attn_k.weight",
                                                                             "attn_v.weight", "ffn_gate.weight")],
                            extra={"blk.0.attn_qkv.weight": (64, 32), "blk.1.attn_qkv.weight": (64, 32),
                                   "blk.0.ffn_up.weight": (128, 32), "blk.1.ffn_up.weight": (128, 32)},
                            values={"blk.1.attn_qkv.weight": qkv, "blk.1.ffn_up.weight": up},
                            kv={"phi3.attention.sliding_window": 16})
        model = formats.read(convert_gguf(source, tmp_path / "p.mlb", tmp_path / "p.mlt", "f32", progress=False)[0])
        parts = {"attn_q.weight": qkv[:32], "attn_k.weight": qkv[32:48], "attn_v.weight": qkv[48:],
                 "ffn_gate.weight": up[:64], "ffn_up.weight": up[64:]}
        for name, rows in parts.items():
            np.testing.assert_array_equal(model.array(f"blk.1.{name}"), rows)
        assert "blk.0.attn_qkv.weight" not in model.tensors
        meta = model.metadata
        assert (meta["arch"], meta["rope_style"], meta["sliding_window"], meta["layer_types"]) == \
            ("phi3", "neox", 16, [1, 1])
        with ContainerFile(str(tmp_path / "p.mlb")):
            pass

    def test_smollm3_and_llama3_rope(self, tmp_path):
        """smollm3: every fourth layer without RoPE; a llama GGUF's rope_freqs.weight is kept as
        it is; LongRoPE's factor tensors are refused by name."""
        source = write_gguf(tmp_path / "s.gguf", "smollm3", n_layers=8)
        meta = formats.read(convert_gguf(source, tmp_path / "s.mlb", tmp_path / "s.mlt", progress=False)[0]).metadata
        assert meta["layer_rope"] == [1, 1, 1, 0, 1, 1, 1, 0] and meta["rope_style"] == "norm"
        factors = np.linspace(1, 8, 8, dtype=np.float32)
        source = write_gguf(tmp_path / "l.gguf", extra={"rope_freqs.weight": (8,)},
                            values={"rope_freqs.weight": factors})
        model = formats.read(convert_gguf(source, tmp_path / "l.mlb", tmp_path / "l.mlt", progress=False)[0])
        np.testing.assert_array_equal(model.array("rope_freqs.weight"), factors)
        source = write_gguf(tmp_path / "r.gguf", "phi3", drop=["blk.0.attn_q.weight"],
                            extra={"rope_factors_long.weight": (8,)})
        with pytest.raises(ConvertError, match="rope_factors_long.weight: LongRoPE"):
            convert_gguf(source, tmp_path / "r.mlb", tmp_path / "r.mlt", progress=False)

    def test_every_source_type_decodes_like_gguf_py(self, tmp_path):
        """F16, BF16, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K/Q5_K source tensors, converted to f32, hold
        exactly gguf-py's dequantized values."""
        rng = np.random.default_rng(4)
        values = {"token_embd.weight": rng.standard_normal((8, 256)).astype(np.float16)}
        encode = {"blk.0.ffn_up.weight": "BF16", "blk.0.ffn_gate.weight": "Q4_1", "blk.0.ffn_down.weight": "Q5_0",
                  "blk.0.attn_output.weight": "Q5_1", "blk.0.attn_k.weight": "Q8_0"}
        raw = {"blk.0.attn_v.weight": "Q4_K", "blk.0.attn_q.weight": "Q5_K"}  # rows of 256 weights
        source = write_gguf(tmp_path / "types.gguf", dim=256, values=values, encode=encode, raw=raw)
        model = formats.read(convert_gguf(source, tmp_path / "t.mlb", tmp_path / "t.mlt", "f32", progress=False)[0])
        by_name = {t.name: t for t in gguf.GGUFReader(source).tensors}
        expected_types = {**encode, **raw, "token_embd.weight": "F16"}
        for name, type_name in expected_types.items():
            assert by_name[name].tensor_type.name == type_name
            raw_rows = np.asarray(by_name[name].data)
            expected = gguf.quants.dequantize(raw_rows, by_name[name].tensor_type).reshape(model.tensors[name].shape)
            np.testing.assert_array_equal(model.array(name), expected.astype(np.float32), err_msg=name)


class HuggingFaceConfigTests:
    """krafla_twisted.convert.hf.hyperparameters on config.json files as transformers writes them
    (the logits themselves are checked against transformers in tests/reference/test_hf_convert.py)."""

    def test_gemma3_multimodal_config_with_only_non_default_text_values(self, capsys):
        """Gemma 3 4B's config.json: text_config lists only what differs from Gemma3TextConfig's
        defaults, so the converter supplies them (head_dim 256, rope bases 1e6 / 1e4, GELU-tanh,
        query_pre_attn_scalar 256, five sliding layers per full one) and keeps linear scaling 8."""
        from krafla_twisted.convert.hf import hyperparameters

        config = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
                  "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                                  "num_attention_heads": 8, "num_hidden_layers": 12, "num_key_value_heads": 4,
                                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}
        arch, _, meta = hyperparameters(config)
        assert "skipping the vision model" in capsys.readouterr().err
        assert arch == "gemma3"
        assert (meta["head_dim"], meta["rope_theta"], meta["rope_theta_local"], meta["rope_scale"]) == (256, 1e6, 1e4, 8.0)
        assert meta["activation"] == "gelu_tanh" and meta["attn_scale"] == 256 ** -0.5
        assert meta["layer_types"] == [1, 1, 1, 1, 1, 0] * 2 and meta["sliding_window"] == 1024

    def test_qwen3_5_config(self):
        """A Qwen3.5 config: layer types from full_attention_interval, a quarter of each head rotated."""
        from krafla_twisted.convert.hf import hyperparameters

        text = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10]}}
        arch, _, meta = hyperparameters({"model_type": "qwen3_5", "text_config": text})
        assert arch == "qwen35"
        assert meta["layer_types"] == [2, 2, 2, 0, 2, 2, 2, 0]
        assert (meta["rope_dims"], meta["rope_theta"], meta["linear_conv_kernel"]) == (16, 1e7, 4)

    def test_refusals(self):
        """Unknown model types and RoPE scalings are refused by name."""
        from krafla_twisted.convert.hf import hyperparameters

        with pytest.raises(ConvertError, match="model_type 'mamba' is not supported"):
            hyperparameters({"model_type": "mamba"})
        base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 96}
        with pytest.raises(ConvertError, match="RoPE type 'yarn': YaRN RoPE scaling is not supported"):
            hyperparameters(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
        with pytest.raises(ConvertError, match="RoPE type 'longrope': LongRoPE"):
            hyperparameters(dict(base, model_type="phi3", rope_scaling={"rope_type": "longrope"}))
        with pytest.raises(ConvertError, match="RoPE scaling together with sliding-window layers"):
            hyperparameters(dict(base, model_type="mistral", sliding_window=8,
                                 rope_scaling={"rope_type": "linear", "factor": 2.0}))

    def test_issue_17_configs(self):
        """qwen3, mistral (its window on every layer), phi3 (partial RoPE) and smollm3 (its
        no-RoPE layers) configs become the .mlb keys of docs/formats.md."""
        from krafla_twisted.convert.hf import hyperparameters

        base = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 96}
        arch, _, meta = hyperparameters(dict(base, model_type="qwen3", head_dim=32))
        assert (arch, meta["head_dim"], meta["rope_style"], meta["sliding_window"]) == ("qwen3", 32, "neox", 0)
        arch, _, meta = hyperparameters(dict(base, model_type="mistral", sliding_window=4096))
        assert (arch, meta["sliding_window"], meta["layer_types"]) == ("mistral", 4096, [1, 1, 1, 1])
        arch, _, meta = hyperparameters(dict(base, model_type="phi3", partial_rotary_factor=0.75))
        assert (arch, meta["head_dim"], meta["rope_dims"]) == ("phi3", 16, 12)
        arch, _, meta = hyperparameters(dict(base, model_type="smollm3", num_hidden_layers=8))
        assert (arch, meta["layer_rope"]) == ("smollm3", [1, 1, 1, 0, 1, 1, 1, 0])
        _, _, meta = hyperparameters(dict(base, model_type="smollm3", no_rope_layers=[0, 1, 1, 1]))
        assert meta["layer_rope"] == [0, 1, 1, 1]
        with pytest.raises(ConvertError, match="no_rope_layers"):
            hyperparameters(dict(base, model_type="smollm3", no_rope_layers=[1, 1]))

    def test_llama3_rope_factors(self):
        """Llama 3.1's divisors (the published Llama-3.1-8B values: theta 500000, factor 8, low 1,
        high 4, original context 8192): the fastest pairs keep their frequency, the slowest are
        divided by 8, the ones between are blended, never decreasing."""
        from krafla_twisted.convert.hf import llama3_rope_factors

        factors = llama3_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192.0)
        assert factors.shape == (64,) and factors.dtype == np.float32
        assert factors[0] == 1.0 and factors[-1] == 8.0
        assert np.all(np.diff(factors) >= 0)
        wavelength = 2 * np.pi * 500000.0 ** (np.arange(64) * 2 / 128)
        between = (wavelength >= 8192 / 4) & (wavelength <= 8192)
        assert between.any() and np.all((factors[between] > 1) & (factors[between] < 8))
        assert np.all(factors[wavelength < 8192 / 4] == 1) and np.all(factors[wavelength > 8192] == 8)
