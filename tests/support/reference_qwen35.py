"""An independent numpy (float64) forward pass of Qwen3.5 (arch qwen35) over a .mlb file.

Written from transformers' Qwen3_5 text model (tests/reference/test_hf_convert.py checks the C
engine against transformers itself; this lets `make test` check the engine without torch):
whole-sequence formulas where the C engine runs token by token, e.g. the causal convolution as a
sum of shifted copies and attention as one masked softmax. Reuses the llama-family pieces of
tests/support/reference.py (dequantize, rms_norm, linear, rope, attention).

`ReferenceQwen35(mlb_path).forward(ids)` gives the logits of every position.
"""

import numpy as np

from krafla_twisted.engine import formats
from tests.support.reference import attention, dequantize, linear, rms_norm, rope


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


class ReferenceQwen35:
    def __init__(self, mlb_path):
        container = formats.read(mlb_path)
        self.meta = container.metadata
        if self.meta["arch"] != "qwen35":
            raise ValueError(f"{mlb_path}: arch {self.meta['arch']!r}, expected qwen35")
        self.tensors = container.tensors

    def w(self, name):
        return dequantize(self.tensors[name]).astype(np.float64)

    def _deltanet(self, i, x):
        m = self.meta
        n = x.shape[0]
        nk, nv, dk, dv, kernel = (m["linear_k_heads"], m["linear_v_heads"], m["linear_k_head_dim"],
                                  m["linear_v_head_dim"], m["linear_conv_kernel"])
        b = f"blk.{i}."
        mixed = linear(x, self.w(b + "attn_qkv.weight"))  # (n, conv_dim)
        conv = self.w(b + "ssm_conv1d.weight")  # (conv_dim, kernel); column kernel-1 is the newest input
        out = np.zeros_like(mixed)
        for j in range(kernel):
            shift = kernel - 1 - j  # weight j multiplies the input `shift` steps back
            if shift < n:  # a prompt shorter than the kernel never reaches the oldest taps
                out[shift:] += conv[:, j] * mixed[:n - shift]
        mixed = _silu(out)
        key_dim = nk * dk
        q = mixed[:, :key_dim].reshape(n, nk, dk)
        k = mixed[:, key_dim:2 * key_dim].reshape(n, nk, dk)
        v = mixed[:, 2 * key_dim:].reshape(n, nv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        q, k = np.repeat(q, nv // nk, axis=1), np.repeat(k, nv // nk, axis=1)
        beta = 1.0 / (1.0 + np.exp(-linear(x, self.w(b + "ssm_beta.weight"))))  # (n, nv)
        g = self.w(b + "ssm_a") * _softplus(linear(x, self.w(b + "ssm_alpha.weight")) + self.w(b + "ssm_dt.bias"))
        state = np.zeros((nv, dk, dv))
        core = np.zeros((n, nv, dv))
        for t in range(n):
            state *= np.exp(g[t])[:, None, None]
            memory = np.einsum("hkv,hk->hv", state, k[t])
            delta = (v[t] - memory) * beta[t][:, None]
            state += k[t][:, :, None] * delta[:, None, :]
            core[t] = np.einsum("hkv,hk->hv", state, q[t])
        z = linear(x, self.w(b + "attn_gate.weight")).reshape(n, nv, dv)
        core = rms_norm(core, self.w(b + "ssm_norm.weight"), m["norm_eps"]) * _silu(z)
        return linear(core.reshape(n, nv * dv), self.w(b + "ssm_out.weight"))

    def _attention(self, i, x, positions):
        m = self.meta
        n, heads, kv_heads, hd = x.shape[0], m["n_heads"], m["n_kv_heads"], m["head_dim"]
        b = f"blk.{i}."
        qg = linear(x, self.w(b + "attn_q.weight")).reshape(n, heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, heads * hd)
        k = linear(x, self.w(b + "attn_k.weight")).reshape(n, kv_heads, hd)
        v = linear(x, self.w(b + "attn_v.weight")).reshape(n, kv_heads, hd)
        q = rope(rms_norm(q, self.w(b + "attn_q_norm.weight"), m["norm_eps"]), positions, m["rope_theta"], 1.0,
                 "neox", m["rope_dims"])
        k = rope(rms_norm(k, self.w(b + "attn_k_norm.weight"), m["norm_eps"]), positions, m["rope_theta"], 1.0,
                 "neox", m["rope_dims"])
        out = attention(q, k, v, positions, positions, m["attn_scale"], 0, 0.0)
        return linear(out * (1.0 / (1.0 + np.exp(-gate))), self.w(b + "attn_output.weight"))

    def forward(self, token_ids):
        """Logits (n_tokens, n_vocab) float64 of every position of `token_ids`."""
        m = self.meta
        positions = np.arange(len(token_ids))
        x = self.w("token_embd.weight")[np.asarray(token_ids)]
        for i, kind in enumerate(m["layer_types"]):
            h = rms_norm(x, self.w(f"blk.{i}.attn_norm.weight"), m["norm_eps"])
            x = x + (self._deltanet(i, h) if kind == 2 else self._attention(i, h, positions))
            h = rms_norm(x, self.w(f"blk.{i}.ffn_norm.weight"), m["norm_eps"])
            gate = linear(h, self.w(f"blk.{i}.ffn_gate.weight"))
            x = x + linear(_silu(gate) * linear(h, self.w(f"blk.{i}.ffn_up.weight")),
                           self.w(f"blk.{i}.ffn_down.weight"))
        x = rms_norm(x, self.w("output_norm.weight"), m["norm_eps"])
        head = "token_embd.weight" if m["tied_embeddings"] else "output.weight"
        return linear(x, self.w(head))
