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

import re

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


def reasoning_token_count(pieces, close=CLOSE):
    """How many of a reply's tokens belong to its reasoning, for a reply that has some (as
    split_reasoning found it): those up to and including the token that completes `close`
    (`</think>`), or all of them when the block never closes. `pieces` are the tokens' bytes, in order."""
    close = close.encode("utf-8")
    seen, count = b"", 0
    for piece in pieces:
        seen, count = seen + piece, count + 1
        if close in seen[-(len(piece) + len(close) - 1):]:
            break
    return count



# --- gpt-oss (harmony)
#
# A reply is messages `[<|start|>]HEADER<|message|>BODY<|end|>`, HEADER `assistant<|channel|>CHANNEL`
# with maybe a recipient `to=...` and a content type; the reply's last message ends at a stop marker
# (<|return|>, <|call|>), which is not in the text. Its text comes with these control tokens
# (generation decodes them for a template with `reply_control_tokens`).

HARMONY_START, HARMONY_MESSAGE, HARMONY_END = "<|start|>", "<|message|>", "<|end|>"
# How the reply's first header may begin: a channel, or a recipient right after the generation
# prompt `<|start|>assistant` (a call, as the required-call grammar writes it)
_HEADER_STARTS = ("<|", " to=")
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")


class HarmonyStream:
    """A gpt-oss reply as it streams: `push(piece)` returns (reasoning, answer) as ReasoningStream
    does. The analysis channel's bodies are the reasoning; the final channel's and a commentary
    without a recipient (a preamble for the user) are the answer; a message to a recipient (a tool
    call) goes to the answer whole once it ends, written as the template writes a call
    (`<|start|>assistant to=RECIPIENT<|channel|>commentary json<|message|>BODY`), for
    tools.HarmonyFormat. Headers and the markers between messages belong to neither. A reply that
    does not start with a header is all answer."""

    def __init__(self):
        self.state = "header"   # then "body", then "between" (after <|end|>), then "header" again
        self.kind = None        # the body's: "reasoning", "answer" or "call"
        self.first = True       # the reply's first header, which may be no header at all
        self.header = ""
        self.held = ""
        self.call = ""          # a call's body so far

    def push(self, piece):
        self.held += piece
        reasoning, answer = [], []
        while self.held:
            text = self.held
            if self.state == "between":
                if text.startswith(HARMONY_START):
                    self.state, self.held = "header", text[len(HARMONY_START):]
                    continue
                if HARMONY_START.startswith(text):
                    break
                self.state = "header"
                continue
            if self.state == "header":
                found = text.find(HARMONY_MESSAGE)
                if found < 0:
                    if self.first and not any(text.startswith(s) or s.startswith(text) for s in _HEADER_STARTS):
                        self.state, self.kind, self.header = "body", "answer", ""  # no header: plain text
                        self.first = False
                        continue
                    break
                self.first = False
                self.header, self.held = text[:found], text[found + len(HARMONY_MESSAGE):]
                channel = self.header.partition("<|channel|>")[2].split(" ")[0].split("<|")[0].strip()
                self.kind = ("call" if _RECIPIENT.search(self.header) else
                             "reasoning" if channel == "analysis" else "answer")
                self.state, self.call = "body", ""
                continue
            found = text.find(HARMONY_END)
            end = found if found >= 0 else len(text) - _partial_tail(text, HARMONY_END)
            body = text[:end]
            if self.kind == "reasoning":
                reasoning.append(body)
            elif self.kind == "answer":
                answer.append(body)
            else:
                self.call += body
            if found < 0:
                self.held = text[end:]
                break
            self.held = text[found + len(HARMONY_END):]
            self.state = "between"
            if self.kind == "call":
                answer.append(self._call_text())
        return "".join(reasoning), "".join(answer)

    def _call_text(self):
        recipient = _RECIPIENT.search(self.header).group(1)
        return f"{HARMONY_START}assistant to={recipient}<|channel|>commentary json{HARMONY_MESSAGE}{self.call}"

    def finish(self):
        """(reasoning, answer) held back at the end: the rest of the last body (a call whole)."""
        rest, self.held = self.held, ""
        if self.state != "body":
            return "", ""
        if self.kind == "call":
            self.call += rest
            return "", self._call_text()
        return (rest, "") if self.kind == "reasoning" else ("", rest)


def split_harmony(text):
    """(reasoning, answer) of a whole gpt-oss reply, exactly as HarmonyStream streams them."""
    stream = HarmonyStream()
    reasoning, answer = stream.push(text)
    rest_reasoning, rest_answer = stream.finish()
    return reasoning + rest_reasoning, answer + rest_answer


def reasoning_stream(template):
    """The stream that splits a reply of `template` (a thinking one)."""
    if getattr(template, "reasoning_format", None) == "harmony":
        return HarmonyStream()
    return ReasoningStream(getattr(template, "opens_think", False))


def split_reply(template, text):
    """(reasoning, answer) of a whole reply of the thinking `template`."""
    stream = reasoning_stream(template)
    reasoning, answer = stream.push(text)
    rest_reasoning, rest_answer = stream.finish()
    return reasoning + rest_reasoning, answer + rest_answer


def reasoning_close(template):
    """What ends a reply's reasoning for reasoning_token_count: `</think>`, or gpt-oss's <|end|>
    (its analysis message comes first)."""
    return HARMONY_END if getattr(template, "reasoning_format", None) == "harmony" else CLOSE
