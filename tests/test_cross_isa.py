"""Every architecture's logits are bitwise equal across the generic, avx2 and avx512 builds.

docs/kernels.md promises one reduction order per kernel in every ISA, so a model gives the same
bits whichever library runs it. Each build of libkrafla.so is loaded in its own subprocess
(tests/support/isa_logits.py, through KRAFLA_LIB) on the same tiny models, for every architecture
and weight type, f32/f16 (and q8_0) KV caches, packed and file-layout weights, and the logits are
compared at zero tolerance. `make test` builds the three libraries (`make lib`); the avx512 one
runs only where the CPU has AVX-512 VNNI.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from krafla_twisted.engine import clib
from tests.support.tiny_models import ARCHS, KQUANTS, QUANTIZED, WEIGHT_TYPES, write_tiny_model
from tests.support.tiny_qwen35 import write_tiny_qwen35

REPO = pathlib.Path(__file__).resolve().parent.parent
BUILD = pathlib.Path(os.environ.get("KRAFLA_BUILD", REPO / "build"))
ALL_ARCHS = ARCHS + ("qwen35",)
# (arch, weight type) pairs: every type for the tiny_models architectures (k-quants in their
# 256-wide KQUANT_SHAPES); the tiny qwen35 model has no k-quant shapes, so it runs the others.
CASES = [(arch, weight_type) for arch in ALL_ARCHS for weight_type in WEIGHT_TYPES + ("odd",)
         if not (arch == "qwen35" and weight_type in KQUANTS)]
# f32 models whose widths are no multiple of 8: every kernel's scalar tail runs.
ODD_SHAPES = {
    "llama": dict(dim=50, head_dim=10, ffn_dim=70),
    "qwen2": dict(dim=42, head_dim=6, n_heads=6, n_kv_heads=3, ffn_dim=45),
    "gemma3": dict(dim=38, head_dim=14, ffn_dim=51),
    "qwen35": dict(dim=44, head_dim=12, ffn_dim=61, linear_k_head_dim=13, linear_v_head_dim=11),
    "qwen3": dict(dim=46, head_dim=10, ffn_dim=53),
    "smollm3": dict(dim=54, head_dim=14, ffn_dim=43),
}


def isas():
    """The builds this CPU runs: generic and avx2 always here (the suite runs on AVX2 machines),
    avx512 where the CPU has what clib loads it for (AVX-512 F/BW/VL and VNNI)."""
    return ["generic", "avx2"] + (["avx512"] if clib.cpu_isa() == "avx512" else [])


def write_model(path, arch, weight_type, odd=False):
    shape = ODD_SHAPES[arch] if odd else {}
    if arch == "qwen35":
        write_tiny_qwen35(path, seed=21, weight_type=weight_type, **shape)
    elif weight_type in KQUANTS:  # KQUANT_SHAPES: head_dim 64 or 128, so the q8_0 KV cache runs too
        write_tiny_model(path, arch, seed=21, weight_type=weight_type)
    else:
        # head_dim 32 (unless odd) so the q8_0 KV cache runs too
        write_tiny_model(path, arch, seed=21, weight_type=weight_type, **(shape or {"head_dim": 32}))


def plan_for(folder):
    """(key, model) items: every architecture x weight type, plus an odd-shaped f32 model each."""
    plan = []
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 60, size=43)]
    for arch, weight_type in CASES:
        path = folder / f"{arch}-{weight_type}.mlb"
        write_model(path, arch, "f32" if weight_type == "odd" else weight_type, odd=weight_type == "odd")
        kvs = ["f32", "f16"] + (["q8_0"] if arch != "qwen35" and weight_type != "odd" else [])
        packs = [True, False] if weight_type in QUANTIZED + KQUANTS else [True]
        for kv in kvs:
            for pack in packs:
                key = f"{arch}/{weight_type}/{kv}/{'packed' if pack else 'file'}"
                plan.append(dict(key=key, path=str(path), ids=ids, kv=kv, batch=16, pack=pack))
    return plan


@pytest.fixture(scope="module")
def logits_by_isa(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross_isa")
    plan = plan_for(folder)
    (folder / "plan.json").write_text(json.dumps(plan))
    results = {}
    for isa in isas():
        library = BUILD / isa / "libkrafla.so"
        assert library.exists(), f"{library} is missing: run `make lib` (it builds all three)"
        out = folder / f"{isa}.npz"
        env = dict(os.environ, KRAFLA_LIB=str(library), KRAFLA_ISA=isa)
        subprocess.run([sys.executable, "-m", "tests.support.isa_logits", str(folder / "plan.json"), str(out)],
                       cwd=REPO, env=env, check=True)
        with np.load(out) as data:
            assert str(data["isa"]) == isa, f"{library} reports ISA {data['isa']}"
            results[isa] = {key: data[key] for key in data.files if key != "isa"}
    return results


class CrossIsaTests:
    """Zero-tolerance equality of logits between the builds, per architecture and weight type."""

    @pytest.mark.parametrize("arch, weight_type", CASES)
    def test_same_bits_in_every_build(self, logits_by_isa, arch, weight_type):
        """The prompt's last logits and three generated steps' are the same float32 bits from the
        generic (plain C), avx2 and avx512 libraries, for every KV type and packed or not."""
        reference = logits_by_isa["generic"]
        keys = [key for key in reference if key.startswith(f"{arch}/{weight_type}/")]
        assert keys
        for isa, results in logits_by_isa.items():
            for key in keys:
                want, got = reference[key].view(np.uint32), results[key].view(np.uint32)
                assert np.isfinite(reference[key]).all(), key
                differ = np.argwhere(want != got)
                assert not differ.size, (f"{key}: {isa} differs from generic in {len(differ)} of {want.size} logits, "
                                         f"first (step, id) {differ[:3].tolist()}")
