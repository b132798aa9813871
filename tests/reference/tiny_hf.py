"""Tiny random Hugging Face models (config.json + model.safetensors), and their .mlb.

`write_tiny_hf_model(folder, arch, seed=..., **config)` builds a transformers model of arch llama,
qwen2 or gemma3 from a small config, fills its weights from a seeded generator at scales that keep
activations near unit size (transformers' own init, std 0.02, makes near-uniform logits that would
hide mistakes), and saves it with save_pretrained: the Hugging Face folder layout that
`krafla convert FOLDER` reads (issue 7).

`mlb_from_safetensors(folder, out)` writes the .mlb these tests compare the numpy reference on.

`prompt`, `cosine`, `hf_logits` and `assert_engine_matches` are the comparisons the reference tests
share: seeded token ids, the cosine of two logit rows, transformers' logits at every position, and
the C engine's last-position logits against transformers' (same argmax, cosine >= 0.9999).
It reads the saved files (config.json, model.safetensors), not the live torch model, and states
the Hugging Face -> krafla conventions in one place:
- Hugging Face keeps q/k rows in the half-split layout, so rope_style is `neox` and no row is
  permuted (llama.cpp permutes llama's q/k into the `norm` layout when it writes GGUF).
- Gemma's RMSNorm multiplies by (1 + w); the .mlb stores 1 + w (also for the q/k norms).
- Gemma 3 names: pre_feedforward_layernorm -> ffn_norm, post_attention_layernorm ->
  post_attention_norm, post_feedforward_layernorm -> post_ffw_norm; llama/qwen2's
  post_attention_layernorm is the pre-MLP norm -> ffn_norm.
- Gemma 3: attn_scale = query_pre_attn_scalar^-0.5, embedding_scale = sqrt(hidden_size),
  rope_theta_local from rope_parameters["sliding_attention"], a linear rope factor only on
  full-attention layers, final_logit_softcapping kept, attn_logit_softcapping dropped (transformers
  ignores it for Gemma 3).
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config, SmolLM3Config)

from krafla_twisted.engine import formats
from krafla_twisted.engine.model import Model

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)

CONFIGS = {
    "llama": (LlamaConfig, dict(rms_norm_eps=1e-5, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": (Qwen2Config, dict(rms_norm_eps=1e-6, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma3": (Gemma3TextConfig, dict(rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=32,
                                      query_pre_attn_scalar=32, sliding_window=4,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # issue 17: Llama 3.1's scaling is llama with rope_type llama3; the others are their own classes
    "qwen3": (Qwen3Config, dict(rms_norm_eps=1e-6, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral": (MistralConfig, dict(rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "phi3": (Phi3Config, dict(rms_norm_eps=1e-5, tie_word_embeddings=False, original_max_position_embeddings=256,
                              pad_token_id=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 1.0})),
    "smollm3": (SmolLM3Config, dict(rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 2000000.0})),
}

_NORM_SUFFIXES = ("norm.weight", "layernorm.weight")


def prompt(n_vocab, length, seed=0):
    """`length` token ids below n_vocab, from a generator seeded with seed + length."""
    return [int(t) for t in np.random.default_rng(seed + length).integers(0, n_vocab, length)]


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def hf_logits(model, ids):
    """transformers' logits at every position of `ids`, float64 (positions, vocab)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def assert_engine_matches(mlb, model, lengths, batch=16):
    """For a prompt of each length, the C engine's last-position logits on `mlb` (evaluated `batch`
    tokens per step) have transformers' argmax and a cosine >= 0.9999 with them."""
    with Model(mlb) as engine:
        for length in lengths:
            ids = prompt(model.config.vocab_size, length)
            expected = hf_logits(model, ids)[-1]
            got = engine.session(batch=batch).eval(ids).astype(np.float64)
            assert int(np.argmax(got)) == int(np.argmax(expected)), length
            assert cosine(got, expected) >= 0.9999, length


def write_tiny_hf_model(folder, arch, *, seed, **config):
    """Save a random tiny `arch` model to `folder` (config.json, model.safetensors); returns the model."""
    config_class, defaults = CONFIGS[arch]
    settings = dict(SHAPE, **defaults)
    settings.update(config)
    if arch == "phi3":
        settings.pop("head_dim")  # Phi-3's head width is hidden_size / heads
    model = AutoModelForCausalLM.from_config(config_class(**settings), dtype=torch.float32,
                                             attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(_NORM_SUFFIXES):
                # Gemma's norms multiply by 1 + w: centre w on 0 there, on 1 elsewhere.
                parameter.copy_((0.0 if arch == "gemma3" else 1.0) + 0.1 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))
    model.eval()
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def _layer_names(arch):
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if arch == "gemma3":
        names.update({
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        })
    else:
        names["post_attention_layernorm.weight"] = "ffn_norm.weight"
    return names


def _rope(config, layer_type):
    parameters = config["rope_parameters"]
    if "rope_theta" not in parameters:
        parameters = parameters[layer_type]
    factor = parameters.get("factor", 1.0) if parameters.get("rope_type") == "linear" else 1.0
    return float(parameters["rope_theta"]), float(factor)


def mlb_from_safetensors(folder, out):
    """Write the .mlb (f32) of the Hugging Face model saved in `folder`; returns its path."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    arch = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}[config["model_type"]]
    gemma = arch == "gemma3"
    weights = load_file(folder / "model.safetensors")
    n_layers, dim = config["num_hidden_layers"], config["hidden_size"]
    head_dim = config.get("head_dim") or dim // config["num_attention_heads"]
    layer_types = config.get("layer_types") or ["full_attention"] * n_layers
    rope_theta, rope_scale = _rope(config, "full_attention")
    rope_theta_local, _ = _rope(config, "sliding_attention") if gemma else (rope_theta, 1.0)
    tied = "lm_head.weight" not in weights
    metadata = {
        "arch": arch, "name": f"tiny-hf-{arch}", "n_vocab": config["vocab_size"], "dim": dim,
        "n_layers": n_layers, "n_heads": config["num_attention_heads"],
        "n_kv_heads": config["num_key_value_heads"], "head_dim": head_dim,
        "ffn_dim": config["intermediate_size"], "max_seq": config["max_position_embeddings"],
        "norm_eps": float(config["rms_norm_eps"]), "rope_theta": rope_theta,
        "rope_theta_local": rope_theta_local, "rope_scale": rope_scale, "rope_style": "neox",
        "rope_dims": head_dim, "activation": "gelu_tanh" if gemma else "silu",
        "tied_embeddings": int(tied), "embedding_scale": math.sqrt(dim) if gemma else 1.0,
        "attn_scale": (config["query_pre_attn_scalar"] if gemma else head_dim) ** -0.5,
        "sliding_window": int(config.get("sliding_window") or 0) if gemma else 0,
        "layer_types": [1 if kind == "sliding_attention" else 0 for kind in layer_types],
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it (qk-norm took
        # its place; llama.cpp applies none either), so these models have no attention softcap.
        "attn_softcap": 0.0,
        "final_softcap": float(config.get("final_logit_softcapping") or 0.0),
        # every matrix below is written as f32, which llama.cpp names file type F32
        "file_type": "F32",
    }
    container = formats.Container(formats.MODEL_MAGIC, metadata)

    def add(name, values):
        values = values.astype(np.float32)
        if gemma and name.endswith("norm.weight"):
            values = values + np.float32(1)
        container.add(name, formats.F32, values.shape, values)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    if not tied:
        add("output.weight", weights["lm_head.weight"])
    for layer in range(n_layers):
        for hf_name, name in _layer_names(arch).items():
            key = f"model.layers.{layer}.{hf_name}"
            if key in weights:
                add(f"blk.{layer}.{name}", weights[key])
    formats.write(out, container)
    return out
