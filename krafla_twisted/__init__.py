"""krafla: an OpenAI-compatible server for language models on your own CPU."""

__version__ = "0.7.0"
