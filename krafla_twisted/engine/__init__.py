"""The engine: the C library (libkrafla.so) through ctypes, and the files it reads.

clib finds, loads and declares the library; header reads krafla.h's constants; model holds a Model
and its Sessions (the forward pass and the KV cache); tokenizer, sampler, pack and kernels bind the
C tokenizer, the sampler, the weight packer and the kernels' test entry points; embedding binds an
encoder's pooled outputs (kr_session_embed) and wordpiece is BERT's tokenizer in Python; formats and container
describe the .mlb and .mlt files. This is the bottom layer: it imports nothing else of krafla_twisted,
and it is the one place that declares C functions. Everything above reaches the C code through it.
"""
