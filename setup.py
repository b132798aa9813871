"""krafla: an OpenAI-compatible server for language models on your own CPU."""
import os
import shutil
import subprocess

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithEngine(build_py):
    """Build engine_c with make, one library per ISA, and ship them all inside the package:
    krafla_twisted/_native/<isa>/libkrafla.so, of which clib.py loads the best the CPU runs."""

    def run(self):
        super().run()
        subprocess.check_call(["make", "lib"])
        libraries = subprocess.check_output(["make", "-s", "--no-print-directory", "print-libraries"], text=True).split()
        for library in libraries:
            isa = os.path.basename(os.path.dirname(library))
            native = os.path.join(self.build_lib, "krafla_twisted", "_native", isa)
            os.makedirs(native, exist_ok=True)
            shutil.copy(library, os.path.join(native, "libkrafla.so"))
        # krafla_twisted/engine/header.py reads the constants of the C API from the header beside the libraries.
        shutil.copy(os.path.join("engine_c", "include", "krafla.h"), os.path.join(self.build_lib, "krafla_twisted", "_native", "krafla.h"))


setup(
    name="krafla",
    version="0.7.0",
    description="OpenAI-compatible language model server for the CPU (Twisted + a C engine)",
    packages=find_packages(include=["krafla_twisted", "krafla_twisted.*"]) + ["twisted.plugins"],
    package_data={
        "twisted.plugins": ["krafla_plugin.py"],
        "krafla_twisted.api": ["web/*.html", "web/*.css", "web/*.js"],  # the chat page at / (api/page.py)
    },
    python_requires=">=3.10",
    install_requires=[
        "twisted>=26.10",
        "treq>=24.9",
        "numpy>=1.26",
        "gguf>=0.17",
        "jinja2>=3.1",  # the converter renders a model's own chat template to name it (chat_file.py)
        "pyopenssl>=24", "service-identity>=24",  # --listen ssl: (owner: ecosystem)
        "llguidance>=1.9",  # response_format and tool calls: the token mask of a grammar (owner: agents)
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6.100",
            "jinja2>=3.1",
            "openai>=1.50",
            "prometheus-client>=0.20",  # tests: parses /metrics as Prometheus would (owner: ecosystem)
            "regex>=2024.4",  # tests: runs llama.cpp's pre-tokenizer patterns as an oracle (owner: tokenizer)
            # tests: agent frameworks against a real server, replies checked against their schemas (owner: agents)
            "jsonschema>=4.20", "hypothesis-jsonschema>=0.23", "instructor>=1.7", "pydantic-ai-slim[openai]>=1.0",
            "langchain-openai>=0.3",
            "litellm>=1.50",  # tests: its own matcher recognises our context-length error (as aider relies on)
            "import-linter>=2.16",  # tests: the layers of krafla_twisted hold (.importlinter)
            # tests: Ollama's /api/* driven by its own Python library and LangChain's ChatOllama (owner: ollama)
            "ollama>=0.4", "langchain-ollama>=0.2",
            "anthropic>=0.40",  # tests: the anthropic SDK drives /v1/messages (owner: anthropic API)
            "openai-agents>=0.2",  # tests: the Agents SDK's default Responses model drives /v1/responses (owner: responses)
            "playwright>=1.50",  # tests: drives Debian's chromium through the chat page at / (owner: webui)
            # tests: RAG clients' embedding classes against /v1/embeddings (owner: embed)
            "llama-index-embeddings-openai-like>=0.1",
            "tokenizers>=0.20",  # tests: Hugging Face's tokenizers builds a decoder reranker's reference prompt (owner: embed)
            "smolagents>=1.20",  # tests: its ToolCallingAgent and CodeAgent against a real server (owner: structured)
        ],
    },
    entry_points={"console_scripts": ["krafla=krafla_twisted.cli.main:main"]},
    cmdclass={"build_py": BuildWithEngine},
)
