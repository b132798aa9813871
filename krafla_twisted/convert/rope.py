"""RoPE scaling the converters write as per-pair divisors (rope_freqs.weight, docs/formats.md).

YaRN (gpt-oss; transformers' rope_type yarn) comes from a Hugging Face config (hf.py) or from a
GGUF's rope.scaling keys (gguf.py), one computation for both.
"""

import math

import numpy as np


def yarn_rope(theta, rope_dims, factor, original_context, beta_fast=32.0, beta_slow=1.0, truncate=True,
              attention_factor=None, mscale=None, mscale_all_dim=None):
    """YaRN (transformers' rope_type yarn) as (one divisor per rotated pair, as rope_freqs.weight
    stores them; the factor q and k are multiplied by). Pairs that turn fewer than beta_slow times
    over original_context are interpolated (divided by `factor`), those that turn more than
    beta_fast times kept, a linear ramp between; the attention factor, 0.1 ln(factor) + 1 unless
    given, scales cos and sin, so q.k by its square."""
    def correction_dim(rotations):
        return rope_dims * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rope_dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    divisors = 1.0 / (ramp / factor + (1 - ramp))

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    return divisors.astype(np.float32), float(attention_factor)
