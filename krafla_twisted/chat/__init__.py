"""Chats as text: the templates that turn messages (and tools) into the prompt a model was trained on.

templates holds the built-in chat templates and the text of their tool calls; template_file reads a
model's own Jinja template from its tokenizer file, recognises which built-in one it is and stores
one there. It may import engine (container, for the tokenizer file) and nothing above it.
"""
