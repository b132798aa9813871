"""Issue 28: the mixture-of-experts architectures (qwen3moe, mixtral, olmoe, gpt-oss) and the expert layer.

- tests/data/tiny-moe-ARCH.mlb are tiny random transformers models (Qwen3MoeForCausalLM,
  MixtralForCausalLM, OlmoeForCausalLM, GptOssForCausalLM: biases, attention sinks, a sliding
  window of 24 on every other layer, YaRN, the clamped SwiGLU) converted at f32 from their Hugging
  Face folders, with
  transformers' last-position logits for prompts of 1 to 300 tokens beside them (.npz, made by
  `python -m tests.reference.tiny_moe` in the reference environment): the engine must give the
  same argmax and a cosine >= 0.9999 after centring, without torch.
- The expert layer groups a step's tokens by expert; a token's logits must not depend on which
  others share its experts. Checked at zero tolerance across step widths, thread counts, packed
  and file-layout weights, several sequences in one step (kr_batch_eval, `--parallel`) and the
  generic/avx2/avx512 builds, on the tiny files and on synthetic qwen3moe models whose experts
  are q8_0, q4_K with q6_K down matrices (Q4_K_M's mix), or mxfp4 (MXFP4_MOE's, the packed mxfp4
  tiles), 256 wide so the k-quant kernels and several 64-row work items per expert run.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from krafla_twisted.engine import clib, formats
from krafla_twisted.engine.model import EngineError, Model
from tests.support.tiny_models import encode

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
BUILD = pathlib.Path(os.environ.get("KRAFLA_BUILD", REPO / "build"))
ARCHS = ("qwen3moe", "mixtral", "olmoe", "gpt-oss")
LENGTHS = (1, 7, 33, 120, 300)  # tests/reference/tiny_moe.py's


def prompt(n_vocab, length, seed=0):
    """tests/reference/tiny_moe.py's prompts: `length` ids from a generator seeded with seed + length."""
    return [int(t) for t in np.random.default_rng(seed + length).integers(0, n_vocab, length)]


def centred_cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def tiny_file(arch):
    return DATA / f"tiny-moe-{arch}.mlb"


# --- synthetic quantized models


def write_quantized_moe(path, weight_type, *, seed=5, n_experts=4, n_used=2, down_type=None, expert_type=None):
    """A random qwen3moe model (dim and expert width 256, 2 layers) whose matrices are `weight_type`
    (the experts' `expert_type`, their down matrices `down_type`), router and norms f32."""
    rng = np.random.default_rng(seed)
    dim, ffn, n_heads, n_kv, head_dim, n_vocab, n_layers = 256, 256, 4, 2, 64, 64, 2
    metadata = {"arch": "qwen3moe", "name": f"synthetic-moe-{weight_type}", "n_vocab": n_vocab, "dim": dim,
                "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim, "ffn_dim": ffn,
                "max_seq": 512, "norm_eps": 1e-6, "rope_theta": 1e6, "rope_style": "neox", "activation": "silu",
                "tied_embeddings": 0, "n_experts": n_experts, "n_experts_used": n_used, "expert_weights_norm": 1}
    container = formats.Container(formats.MODEL_MAGIC, metadata)

    def matrix(name, shape, type_name=weight_type):
        values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        tensor_type, data = encode(values, type_name)
        container.add(name, tensor_type, shape, data)

    def vector(name, size):
        container.add(name, formats.F32, (size,), (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", (n_vocab, dim), "q8_0")
    for layer in range(n_layers):
        blk = f"blk.{layer}."
        vector(blk + "attn_norm.weight", dim)
        matrix(blk + "attn_q.weight", (n_heads * head_dim, dim))
        matrix(blk + "attn_k.weight", (n_kv * head_dim, dim))
        matrix(blk + "attn_v.weight", (n_kv * head_dim, dim))
        matrix(blk + "attn_output.weight", (dim, n_heads * head_dim))
        vector(blk + "attn_q_norm.weight", head_dim)
        vector(blk + "attn_k_norm.weight", head_dim)
        vector(blk + "ffn_norm.weight", dim)
        router = (3 * rng.standard_normal((n_experts, dim)) / np.sqrt(dim)).astype(np.float32)
        container.add(blk + "ffn_gate_inp.weight", formats.F32, router.shape, router)
        matrix(blk + "ffn_gate_exps.weight", (n_experts, ffn, dim), expert_type or weight_type)
        matrix(blk + "ffn_up_exps.weight", (n_experts, ffn, dim), expert_type or weight_type)
        matrix(blk + "ffn_down_exps.weight", (n_experts, dim, ffn), down_type or expert_type or weight_type)
    vector("output_norm.weight", dim)
    matrix("output.weight", (n_vocab, dim), "q8_0")
    formats.write(path, container)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> .mlb path: the tiny f32 files and three synthetic quantized ones."""
    folder = tmp_path_factory.mktemp("moe")
    found = {arch: tiny_file(arch) for arch in ARCHS}
    found["q8_0"] = write_quantized_moe(folder / "q8_0.mlb", "q8_0")
    found["q4_K_M"] = write_quantized_moe(folder / "q4_K_M.mlb", "q4_K", down_type="q6_K", n_experts=5, n_used=3)
    found["mxfp4"] = write_quantized_moe(folder / "mxfp4.mlb", "q8_0", expert_type="mxfp4", n_experts=6, n_used=3)
    return found


MODELS = ARCHS + ("q8_0", "q4_K_M", "mxfp4")


class TransformersLogitsTests:
    """The engine against transformers' logits stored beside the tiny files."""

    @pytest.mark.parametrize("arch", ARCHS)
    def test_matches_transformers(self, arch):
        """For prompts of 1 to 300 tokens (16 per step), the last position's logits have
        transformers' argmax and a centred cosine >= 0.9999 with them."""
        with np.load(DATA / f"tiny-moe-{arch}.npz") as expected, Model(tiny_file(arch)) as model:
            assert model.arch == arch
            for length in LENGTHS:
                want = expected[f"len{length}"]
                got = model.session(batch=16).eval(prompt(model.n_vocab, length))
                assert int(np.argmax(got)) == int(np.argmax(want)), length
                assert centred_cosine(got, want) >= 0.9999, length


class BatchInvarianceTests:
    """A token's logits do not depend on the tokens that share its step or its experts."""

    @pytest.mark.parametrize("name", MODELS)
    def test_same_bits_across_steps_threads_and_packing(self, models, name):
        """Every position's logits of a 70-token prompt are bitwise those of one token per step on
        one thread, for steps of 5, 16 and 70 tokens, 1 to 3 threads, packed or file layout."""
        ids = prompt(64, 70, seed=3)
        with Model(models[name], threads=1, pack=False) as model:
            want = model.session(batch=1).eval_all(ids)
        assert np.isfinite(want).all()
        for threads in (1, 2, 3):
            for pack in (True, False):
                with Model(models[name], threads=threads, pack=pack) as model:
                    for batch in (5, 16, 70):
                        got = model.session(batch=batch).eval_all(ids)
                        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (threads, pack, batch)

    @pytest.mark.parametrize("name", MODELS)
    def test_parallel_sequences_same_bits_as_alone(self, models, name):
        """Three sequences prefilled and then generating in the same steps (kr_batch_eval, as
        --parallel runs them) get bitwise the logits each gets alone."""
        prompts = [prompt(64, n, seed=11) for n in (9, 23, 4)]
        follow = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        with Model(models[name], threads=2) as model:
            alone = []
            for ids, more in zip(prompts, follow):
                session = model.session(batch=8)
                rows = [session.eval(ids)] + [session.eval([token]) for token in more]
                alone.append(np.stack(rows))
            sessions = [model.session(batch=64) for _ in prompts]
            together = [[row] for row in model.eval_batch([(s, ids, "last") for s, ids in zip(sessions, prompts)])]
            for step in range(3):
                for rows, got in zip(together, model.eval_batch([(s, [more[step]], "last")
                                                                  for s, more in zip(sessions, follow)])):
                    rows.append(got)
        for want, rows in zip(alone, together):
            assert np.array_equal(np.stack(rows).view(np.uint32), want.view(np.uint32))


def isas():
    """The builds this CPU runs (tests/test_cross_isa.py's rule)."""
    return ["generic", "avx2"] + (["avx512"] if clib.cpu_isa() == "avx512" else [])


class CrossIsaTests:
    """The same bits from the generic, avx2 and avx512 libraries, each in its own process."""

    def test_same_bits_in_every_build(self, models, tmp_path):
        """Each model's prompt logits and three generated steps' (tests/support/isa_logits.py), f32
        and q8_0 KV caches, packed and file layout, 2 threads: identical float32 bits per build."""
        ids = prompt(64, 43, seed=4)
        plan = [dict(key=f"{name}/{kv}/{pack}", path=str(models[name]), ids=ids, kv=kv, batch=16, pack=pack, threads=2)
                for name in MODELS for kv in ("f32", "q8_0") for pack in (True, False)
                if kv == "f32" or name in ("q8_0", "q4_K_M")]  # q8_0 caches need head_dim % 32 == 0
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        results = {}
        for isa in isas():
            library = BUILD / isa / "libkrafla.so"
            assert library.exists(), f"{library} is missing: run `make lib` (it builds all three)"
            out = tmp_path / f"{isa}.npz"
            env = dict(os.environ, KRAFLA_LIB=str(library), KRAFLA_ISA=isa)
            subprocess.run([sys.executable, "-m", "tests.support.isa_logits", str(tmp_path / "plan.json"), str(out)],
                           cwd=REPO, env=env, check=True)
            with np.load(out) as data:
                assert str(data["isa"]) == isa
                results[isa] = {key: data[key] for key in data.files if key != "isa"}
        reference = results["generic"]
        for isa, got in results.items():
            for item in plan:
                key = item["key"]
                assert np.isfinite(reference[key]).all(), key
                assert np.array_equal(got[key].view(np.uint32), reference[key].view(np.uint32)), (isa, key)


class RefusalTests:
    """Bad MoE files get a clear error, never a crash."""

    def _write(self, path, **changes):
        container = formats.read(tiny_file("qwen3moe"))
        for key, value in changes.items():
            if value is None:
                del container.metadata[key]
            else:
                container.metadata[key] = value
        formats.write(path, container)
        return path

    @pytest.mark.parametrize("changes, message", [
        (dict(n_experts=None), "n_experts is missing"),
        (dict(n_experts_used=7), "n_experts_used"),
        (dict(n_experts=5), "ffn_gate_inp.weight has shape"),
        (dict(ffn_dim=64), "ffn_gate_exps.weight has 3 dimensions"),
    ])
    def test_bad_metadata(self, tmp_path, changes, message):
        """Missing or inconsistent expert metadata is refused at open, naming what is wrong."""
        path = self._write(tmp_path / "bad.mlb", **changes)
        with pytest.raises(EngineError, match=message):
            Model(path)

    @pytest.mark.parametrize("change, message", [
        ("swiglu_limit", "swiglu_limit is missing"),
        ("blk.1.attn_sinks.weight", r"blk.1.attn_sinks.weight\[2\] = nan, expected a finite logit"),
        ("blk.0.ffn_up_exps.bias", "blk.0.ffn_up_exps.bias has shape"),
        ("blk.0.attn_output.bias", "tensor blk.0.attn_output.bias"),
    ])
    def test_bad_gpt_oss_file(self, tmp_path, change, message):
        """A gpt-oss file without its SwiGLU limit, with a NaN sink logit, a bias of the wrong shape
        or a missing bias is refused at open, naming the key or tensor."""
        container = formats.read(tiny_file("gpt-oss"))
        if change in container.metadata:
            del container.metadata[change]
        elif change.endswith("sinks.weight"):
            sinks = container.array(change).copy()
            sinks[2] = np.nan
            container.add(change, formats.F32, sinks.shape, sinks)
        elif change.endswith("exps.bias"):
            bias = container.array(change)[:, :-1].copy()
            container.add(change, formats.F32, bias.shape, bias)
        else:
            del container.tensors[change]
        formats.write(tmp_path / "bad.mlb", container)
        with pytest.raises(EngineError, match=message):
            Model(tmp_path / "bad.mlb")


class GptOssFolderRefusalTests:
    """What the folder converter cannot read of gpt-oss is refused naming it."""

    def test_mxfp4_blocks_are_refused(self, tmp_path):
        """A folder holding MXFP4 expert blocks (U8 `*_blocks`, as OpenAI's checkpoints) is refused
        naming the tensor and pointing to a GGUF, not with a dtype error alone."""
        from krafla_twisted.convert.gguf import ConvertError
        from krafla_twisted.convert.hf import convert_hf

        name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        header = json.dumps({name: {"dtype": "U8", "shape": [2, 16], "data_offsets": [0, 32]}}).encode()
        (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(32))
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "gpt_oss", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 2,
            "num_experts_per_tok": 1, "sliding_window": 8, "vocab_size": 10}))
        with pytest.raises(ConvertError, match=f"{name} holds MXFP4 blocks .* convert a GGUF"):
            convert_hf(tmp_path, tmp_path / "out.mlb", None, "f32", progress=False)


class MemoryTests:
    """A model larger than the machine's RAM is refused at start; --mlock locks what is loaded."""

    def test_model_larger_than_ram_is_refused(self, tmp_path):
        """`krafla run` on a (sparse) model file of twice the machine's RAM exits with a message
        naming the file's size and the RAM's, before it maps anything."""
        from krafla_twisted.cli.startup import total_memory

        total = total_memory()
        assert total, "/proc/meminfo has no MemTotal"
        huge = tmp_path / "huge.mlb"
        with open(huge, "wb") as f:
            f.truncate(2 * total)
        result = subprocess.run([sys.executable, "-m", "krafla_twisted.cli.main", "run", str(huge), "-z",
                                 str(tmp_path / "any.mlt"), "-p", "hi"], capture_output=True, text=True, cwd=REPO,
                                timeout=120)
        output = result.stdout + result.stderr
        assert result.returncode != 0, output
        assert f"is {2 * total / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB of RAM" in output
        assert "Traceback" not in output, output

    def test_mlock_locks_the_loaded_model(self):
        """lock_memory (--mlock) after a model is open leaves its pages locked (VmLck covers the
        file's size), in a process of its own."""
        code = ("import sys; from krafla_twisted.engine.model import Model; "
                "from krafla_twisted.cli.startup import lock_memory; m = Model(sys.argv[1]); lock_memory(); "
                "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmLck')][0])")
        result = subprocess.run([sys.executable, "-c", code, str(tiny_file("qwen3moe"))], capture_output=True,
                                text=True, cwd=REPO, timeout=120)
        assert result.returncode == 0, result.stderr
        assert int(result.stdout) * 1024 >= tiny_file("qwen3moe").stat().st_size
