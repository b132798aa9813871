"""The HTTP layer: Twisted resources that speak OpenAI's API, Anthropic's, Ollama's (and llama-server's extras).

routes is the table of endpoints; resources parses OpenAI's requests and answers them (Reply: the one
reply machinery every API shares), schema validates their bodies and errors shapes OpenAI's errors;
responses, anthropic and ollama translate their APIs onto the same request and Reply; backend is the
one way to the model, through generation; worker runs the model's steps off the reactor thread; sse
streams; access, listen, site, metrics and tokenize are the door's rules, sockets, connection limits,
counters and llama-server's /tokenize; page serves the browser's chat page (web/) at /; embeddings serves
/v1/embeddings, /v1/rerank and Ollama's embed; models is the registry of a server of several models
(--models), routing each request to its model's own backend, worker and tree. It may import generation and chat, never engine: api/ does
not touch ctypes or the C library.
"""
