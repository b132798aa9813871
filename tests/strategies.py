"""Hypothesis strategies shared by the tests (append new ones in their own section)."""

import numpy as np
from hypothesis import strategies as st

from krafla_twisted import formats
from tests.support import tiny_models

# ------------------------------------------------------------------------------------------
# Tiny model shapes (tests/support/tiny_models.py)


@st.composite
def tiny_model_shapes(draw, weight_type="f32", max_dim=128):
    """Keyword arguments for write_tiny_model's shape: GQA ratios 1..4, even head widths,
    odd and even vocab sizes; every matrix input a multiple of 32 for quantized types."""
    quantized = weight_type in tiny_models.QUANTIZED
    n_kv_heads = draw(st.integers(1, 3))
    n_heads = n_kv_heads * draw(st.integers(1, 4))
    if quantized:
        # n_heads * head_dim must be a multiple of 32: head_dim a multiple of 32 / gcd.
        step = 32 // np.gcd(32, n_heads)
        head_dim = step * draw(st.integers(1, 64 // step))  # step is 4, 8, 16 or 32: even
        dim = 32 * draw(st.integers(1, max_dim // 32))
        ffn_dim = 32 * draw(st.integers(1, 2 * max_dim // 32))
    else:
        head_dim = 2 * draw(st.integers(1, 16))
        dim = draw(st.integers(1, max_dim))
        ffn_dim = draw(st.integers(1, 2 * max_dim))
    return dict(
        n_vocab=draw(st.integers(2, 300)),
        dim=dim,
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        max_seq=draw(st.sampled_from([16, 32, 64, 128])),
    )


@st.composite
def tiny_models_args(draw, archs=tiny_models.ARCHS, weight_types=tiny_models.WEIGHT_TYPES):
    """(arch, weight_type, kwargs) for write_tiny_model, kwargs including seed and the shape."""
    arch = draw(st.sampled_from(archs))
    weight_type = draw(st.sampled_from(weight_types))
    kwargs = draw(tiny_model_shapes(weight_type))
    kwargs["seed"] = draw(st.integers(0, 2**32 - 1))
    return arch, weight_type, kwargs


# ------------------------------------------------------------------------------------------
# Container contents (krafla_twisted/formats.py)

names = st.text(st.characters(exclude_characters="\0", exclude_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda s: len(s.encode()) <= formats.MAX_NAME)
ints = st.integers(-(2**63), 2**63 - 1)
floats = st.floats(allow_nan=False, width=64)  # NaN != NaN would make equality checks useless
metadata_values = st.one_of(
    ints,
    floats,
    st.text(max_size=60),
    st.lists(ints, max_size=12),
    st.lists(floats, min_size=1, max_size=12),  # an empty list is written as ints
)


@st.composite
def tensor_shapes(draw, tensor_type):
    """1 to 4 dimensions, the last a multiple of the type's block, at most ~2k elements."""
    n_dims = draw(st.integers(1, formats.MAX_DIMS))
    shape = [draw(st.integers(1, 5)) for _ in range(n_dims - 1)]
    shape.append(tensor_type.block * draw(st.integers(1, 3 if tensor_type.block > 1 else 70)))
    return tuple(shape)


@st.composite
def tensors(draw):
    """(type, shape, raw bytes) with random contents (any bit pattern is a valid tensor)."""
    tensor_type = draw(st.sampled_from(list(formats.TENSOR_TYPES.values())))
    shape = draw(tensor_shapes(tensor_type))
    n_bytes = tensor_type.nbytes(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)
    return tensor_type, shape, raw


@st.composite
def containers(draw, magic=None):
    """A formats.Container with random metadata of every kind and random tensors."""
    magic = magic or draw(st.sampled_from([formats.MODEL_MAGIC, formats.TOKENIZER_MAGIC]))
    container = formats.Container(magic)
    container.metadata.update(draw(st.dictionaries(names, metadata_values, max_size=8)))
    for name, (tensor_type, shape, raw) in draw(st.dictionaries(names, tensors(), max_size=5)).items():
        container.add(name, tensor_type, shape, raw)
    return container
