"""The reasoning of a thinking template's reply, split from its answer.

    reasoning, answer = split_reasoning(reply_text, opened=True)
    stream = ReasoningStream(opened=True)
    reasoning, answer = stream.push(piece)      # each piece, as it comes
    reasoning, answer = stream.finish()         # what was held back, at the end

A thinking template (qwen3.5, qwen3, smollm3; `template.thinking`) makes a reply of the form
`REASONING</think>\\n\\nANSWER`. With `opened` the generation prompt opened the `<think>` block
(Qwen3.5), so the reply starts inside it; otherwise (Qwen3, SmolLM3) the model writes `<think>`
itself, and a reply that does not start with it (after whitespace) has no reasoning at all: it is
all answer (SmolLM3's `/no_think`). The blank lines right after `</think>` belong to neither.

A reply that never closes the block is all reasoning and no answer: a model stopped by max_tokens
(finish_reason "length") in the middle of its thinking has said nothing yet.

`ReasoningStream` holds back what may still grow into `<think>` or `</think>` across pieces, as
tools.ToolStream holds back a partial trigger; `split_reasoning` is the same stream over the whole
text, so a streamed reply always adds up to the whole one.
"""

OPEN = "<think>"
CLOSE = "</think>"


def _partial_tail(text, tag):
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Streamed text of a thinking template's reply: `push(piece)` returns (reasoning, answer), the
    text of the piece that can go out now on each side; `finish()` the held-back rest."""

    def __init__(self, opened=True):
        self.state = "reasoning" if opened else "start"   # then "gap" (after </think>), then "answer"
        self.held = ""

    def push(self, piece):
        self.held += piece
        reasoning, answer = [], []
        while True:
            text = self.held
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.held = "reasoning", stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):
                    break   # whitespace or a part of <think>: not decided yet
                self.state = "answer"
                continue
            if self.state == "reasoning":
                found = text.find(CLOSE)
                if found >= 0:
                    reasoning.append(text[:found])
                    self.state, self.held = "gap", text[found + len(CLOSE):]
                    continue
                keep = _partial_tail(text, CLOSE)
                reasoning.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            if self.state == "gap":
                rest = text.lstrip("\n")
                self.held = rest
                if rest:
                    self.state = "answer"
                    continue
                break
            answer.append(text)
            self.held = ""
            break
        return "".join(reasoning), "".join(answer)

    def finish(self):
        """(reasoning, answer) held back at the end: a partial `</think>` is reasoning, the start
        of a reply that never became `<think>` is answer."""
        rest, self.held = self.held, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def split_reasoning(text, opened=True):
    """(reasoning, answer) of a whole reply, exactly as ReasoningStream streams them."""
    stream = ReasoningStream(opened)
    reasoning, answer = stream.push(text)
    rest_reasoning, rest_answer = stream.finish()
    return reasoning + rest_reasoning, answer + rest_answer


def reasoning_token_count(pieces):
    """How many of a reply's tokens belong to its reasoning, for a reply that has some (as
    split_reasoning found it): those up to and including the token that completes `</think>`, or
    all of them when the block never closes. `pieces` are the tokens' bytes, in order."""
    close = CLOSE.encode("utf-8")
    seen, count = b"", 0
    for piece in pieces:
        seen, count = seen + piece, count + 1
        if close in seen[-(len(piece) + len(close) - 1):]:
            break
    return count


# gpt-oss (harmony): a reply is messages, `[<|start|>assistant]<|channel|>CHANNEL<|message|>BODY`
# ended by <|end|> (or the reply's end: <|return|> and <|call|> are stop markers)
HARMONY_MESSAGE_END = "<|end|>"


def split_harmony(text):
    """(reasoning, answer) of a gpt-oss reply written with its control tokens: the analysis
    channel's bodies are the reasoning; the final channel's and the commentary channel's without a
    recipient (a preamble to the user) are the answer, joined as they come; a message to a
    recipient (a tool call) stays in the answer in the template's own form, for tools.HarmonyFormat
    to read. A reply with no header at all is all answer."""
    reasoning, answer = [], []
    for message in text.split("<|start|>"):
        header, found, body = message.partition("<|message|>")
        if not found:
            answer.append(message)
            continue
        body = body.split(HARMONY_MESSAGE_END, 1)[0]
        channel = header.partition("<|channel|>")[2].split(" ")[0].split("<|")[0].strip()
        if "to=" in header:
            answer.append("<|start|>" + message.split(HARMONY_MESSAGE_END, 1)[0])
        elif channel == "analysis":
            reasoning.append(body)
        else:
            answer.append(body)
    return "".join(reasoning), "".join(answer)
