"""Conversion: GGUF files and Hugging Face folders to krafla's .mlb model and .mlt tokenizer files.

gguf and hf read the two sources (bert: BERT-family encoder folders; moe holds the mixture-of-experts
architectures' share of both; rope the YaRN frequencies both write for gpt-oss), quantize holds numpy (de)quantizers of ggml's block types, and
tokenizer and tokenizer_json build the tokenizer file. It may import engine (formats: the file
layout) and chat (template_file: the template stored with the tokenizer); nothing here calls the C
library, and nothing here knows of generation, HTTP or the command line.
"""
