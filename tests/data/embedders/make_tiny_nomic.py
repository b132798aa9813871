"""Write tiny-nomic-bert.gguf: a random nomic-bert (nomic-embed-text's architecture) as llama.cpp
names it, for tests/test_embeddings.py. Needs only numpy and the gguf package:

    .venv/bin/python tests/data/embedders/make_tiny_nomic.py

The file is what llama.cpp's convert_hf_to_gguf.py writes for nomic-embed-text-v1.5, shrunk:
general.architecture nomic-bert, its hyperparameters under nomic-bert.*, RoPE base 1000, mean
pooling; token_embd, token_types (2 rows) and token_embd_norm; per layer a fused attn_qkv (q, k, v
rows), attn_output, ffn_up / ffn_gate / ffn_down (SwiGLU) and the two post-LayerNorms, no biases;
f16 matrices and f32 vectors, as in the real file. Its vocabulary is tiny-bert's (tokenizer.json
beside this script) spelled as llama.cpp spells a BERT vocabulary: a word-initial piece with a
leading U+2581, a continuation without its `##`, the control tokens as they are. The weights are
random (seed 27): no licence attaches to them.
"""

import json
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "tiny-nomic-bert.gguf"
ARCH = "nomic-bert"
N_LAYERS, DIM, N_HEADS, FFN, CONTEXT = 2, 32, 4, 44, 64  # FFN no multiple of 8: the kernels' tails run
ROPE_BASE, EPS = 1000.0, 1e-12
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def vocabulary():
    """tiny-bert's tokens by id, spelled as llama.cpp spells them, and their GGUF token types."""
    model = json.loads((HERE / "tiny-bert" / "tokenizer.json").read_text())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    tokens, types = [], []
    for token, _ in by_id:
        if token in SPECIALS:
            tokens.append(token), types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write(path, skip=(), causal=False):
    """The tiny model into `path` (tests: without the tensors named in `skip`, or marked causal)."""
    rng = np.random.default_rng(27)
    tokens, types = vocabulary()
    ids = {t: i for i, t in enumerate(tokens)}

    def matrix(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    def norm(scale=0.1):
        return (1 + scale * rng.standard_normal(DIM)).astype(np.float32)

    tensors = {}
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_name("tiny-nomic-bert")
    writer.add_block_count(N_LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(N_HEADS)
    writer.add_layer_norm_eps(EPS)
    writer.add_causal_attention(causal)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_eos_token_id(ids["[SEP]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_pad_token_id(ids["[PAD]"])
    # numpy shapes (rows, cols); GGUF lists the dimensions the other way round
    tensors["token_embd.weight"] = rng.standard_normal((len(tokens), DIM)).astype(np.float16)
    tensors["token_types.weight"] = (0.5 * rng.standard_normal((2, DIM))).astype(np.float32)
    tensors["token_embd_norm.weight"] = norm()
    tensors["token_embd_norm.bias"] = norm() - 1
    for i in range(N_LAYERS):
        tensors[f"blk.{i}.attn_qkv.weight"] = matrix(3 * DIM, DIM)
        tensors[f"blk.{i}.attn_output.weight"] = matrix(DIM, DIM)
        tensors[f"blk.{i}.attn_output_norm.weight"] = norm()
        tensors[f"blk.{i}.attn_output_norm.bias"] = norm() - 1
        tensors[f"blk.{i}.ffn_up.weight"] = matrix(FFN, DIM)
        tensors[f"blk.{i}.ffn_gate.weight"] = matrix(FFN, DIM)
        tensors[f"blk.{i}.ffn_down.weight"] = matrix(DIM, FFN)
        tensors[f"blk.{i}.layer_output_norm.weight"] = norm()
        tensors[f"blk.{i}.layer_output_norm.bias"] = norm() - 1
    for name, values in tensors.items():
        if name not in skip:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    write(OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
