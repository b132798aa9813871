"""The npm clients of the other API dialects against a real `twistd -n krafla` with an API key: the
openai package's Responses API (`client.responses.create`, plain and streamed) and @anthropic-ai/sdk's
Messages API (`messages.create` and `messages.stream(...).finalMessage()`), driven by
tests/node/dialects.mjs. At the server's default temperature (0) each dialect says what
/v1/chat/completions says for the same one user message and token limit.
"""

import json
import os
import subprocess

import httpx2
import pytest

from tests.support.real_models import real_model
from tests.support.server import REPO, ServerProcess

KEY = "sk-test-dialects"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
NODE_DIR = os.path.join(REPO, "tests", "node")


@pytest.fixture(scope="module")
def server():
    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", model.chat, "-t", "2",
                             "--api-key", KEY]).start()
    yield process
    process.stop()


def npm_install_if_needed():
    """As tests/test_clients_api.py: `npm install` in tests/node when the package is not installed yet."""
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "@anthropic-ai", "sdk")):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, check=True, timeout=600)


def chat_text(server):
    """What /v1/chat/completions answers to QUESTION alone, at the server's default temperature."""
    response = httpx2.post(server.url("/chat/completions"), headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                           json={"model": "local", "max_tokens": MAX_TOKENS,
                                 "messages": [{"role": "user", "content": QUESTION}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


class NodeDialectsTests:
    """tests/node/dialects.mjs: the Responses and Messages APIs through their own npm clients."""

    def test_responses_and_messages(self, server):
        """Streamed text equals plain text in each API, and both equal the chat completion's text."""
        npm_install_if_needed()
        result = subprocess.run(["node", "dialects.mjs", server.base_url, KEY, QUESTION, str(MAX_TOKENS)],
                                cwd=NODE_DIR, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        expected = chat_text(server)
        assert expected  # a greedy reply to this question is not empty

        responses, responses_stream = out["responses"], out["responses_stream"]
        assert responses["id"].startswith("resp_") and responses["status"] in ("completed", "incomplete")
        assert responses_stream["text"] == responses["text"]
        assert responses_stream["final_text"] == responses["text"]
        assert responses_stream["first"] == "response.created"
        assert responses_stream["last"] in ("response.completed", "response.incomplete")
        assert responses["text"] == expected

        messages, messages_stream = out["messages"], out["messages_stream"]
        assert messages["id"].startswith("msg_") and messages["stop_reason"] in ("end_turn", "max_tokens")
        assert messages_stream["text"] == messages["text"]
        assert messages_stream["deltas"] == messages["text"]
        assert messages_stream["stop_reason"] == messages["stop_reason"]
        assert messages["text"] == expected
        assert messages["output_tokens"] == responses["output_tokens"]
