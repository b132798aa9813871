"""Tiny random mixture-of-experts models (Qwen3MoeForCausalLM, MixtralForCausalLM, OlmoeForCausalLM,
GptOssForCausalLM).

`write_tiny_moe(folder, arch, seed=..., **config)` saves a transformers model with a few experts
(weights drawn at unit-preserving scales, as tests/reference/tiny_hf.py does, the router larger
so that choices are clear-cut rather than near-ties) with save_pretrained. The gpt-oss model keeps
its own config's features within reach of 300-token prompts: a sliding window of 24, YaRN from an
original context of 128 (its ramp falls inside the 8 rotated pairs), and a SwiGLU limit of 1.5 so
the clamps engage. Run as a script,
`python -m tests.reference.tiny_moe`, it regenerates the main suite's files in tests/data: for each
architecture `tiny-moe-ARCH.mlb` (f32, converted by krafla_twisted.convert.hf) and
`tiny-moe-ARCH.npz`, transformers' last-position logits for the prompts tests/test_moe.py checks.
"""

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

from krafla_twisted.convert.hf import convert_hf

DATA = Path(__file__).resolve().parent.parent / "data"
SHAPE = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, num_experts_per_tok=2)
CONFIGS = {
    "qwen3moe": (Qwen3MoeConfig, dict(num_experts=6, moe_intermediate_size=80, intermediate_size=128,
                                      norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral": (MixtralConfig, dict(num_local_experts=5, intermediate_size=40, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False, sliding_window=None,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "olmoe": (OlmoeConfig, dict(num_experts=6, num_experts_per_tok=3, intermediate_size=40, norm_topk_prob=False,
                                rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0,
                                eos_token_id=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt-oss": (GptOssConfig, dict(num_local_experts=6, intermediate_size=40, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, sliding_window=24, swiglu_limit=1.5,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False})),
}
# gpt-oss keeps its experts transposed, (experts, input features, outputs): the fan-in is the middle axis
TRANSPOSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# The prompt lengths tests/test_moe.py compares (1 to 300 tokens).
LENGTHS = (1, 7, 33, 120, 300)
ROUTER_SCALE = 3.0


def prompt(n_vocab, length, seed=0):
    """`length` token ids below n_vocab, from a generator seeded with seed + length."""
    return [int(t) for t in np.random.default_rng(seed + length).integers(0, n_vocab, length)]


def write_tiny_moe(folder, arch, *, seed, **config):
    """Save a random tiny `arch` model to `folder` (config.json, model.safetensors); returns the model."""
    config_class, defaults = CONFIGS[arch]
    settings = dict(SHAPE, **defaults)
    settings.update(config)
    if arch == "olmoe":
        settings.pop("head_dim")  # OLMoE's q/k norms are as wide as hidden_size: heads of hidden / n_heads
    model = AutoModelForCausalLM.from_config(config_class(**settings), dtype=torch.float32,
                                             attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("gate.weight", "router.weight")):  # the router
                parameter.copy_(ROUTER_SCALE * noise / math.sqrt(parameter.shape[-1]))
            elif name.endswith(TRANSPOSED_EXPERTS) and arch == "gpt-oss":
                parameter.copy_(noise / math.sqrt(parameter.shape[-2]))
            else:  # matrices, and gpt-oss's biases and sinks alike
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]))
    model.eval()
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return model


def last_logits(model, ids):
    """transformers' logits after the last token of `ids`, float64 (vocab,)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double().numpy()


def regenerate(arch):
    """tests/data/tiny-moe-ARCH.mlb and .npz from a freshly drawn model (seed fixed per arch)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_moe(Path(tmp) / "hf", arch, seed=28 + sorted(CONFIGS).index(arch))
        mlb = DATA / f"tiny-moe-{arch}.mlb"
        convert_hf(Path(tmp) / "hf", mlb, None, "f32", progress=False, name=f"tiny-moe-{arch}")
        logits = {f"len{length}": last_logits(model, prompt(model.config.vocab_size, length)).astype(np.float32)
                  for length in LENGTHS}
        np.savez(DATA / f"tiny-moe-{arch}.npz", **logits)
    return mlb


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(CONFIGS):
        print(regenerate(name))
