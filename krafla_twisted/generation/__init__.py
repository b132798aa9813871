"""Generation: from a prompt to tokens, for one request or many at once.

generate holds the Runtime (a model, its slots, the tokenizer, the chat template and the defaults a
request falls back on) and the Generator that samples, stops and counts; scheduler steps every
running request together, one batch per step; grammar constrains sampling to a JSON schema or a
grammar with llguidance, and gbnf reads llama.cpp's GBNF grammars into its grammar; speculate proposes tokens (prompt lookup or a draft model) that one
forward step checks, without changing the reply; tools finds tool calls in a reply, reasoning a thinking template's
reasoning before its answer; embeddings pools and normalises an encoder's vectors and scores a reranker's
pairs. It may import engine and chat; it knows
nothing of HTTP, of the command line's options or of downloads.
"""
