"""`krafla run`: generate from the command line (the original's ml_run).

    krafla run MODEL.mlb -z TOK.mlt -p "Once upon a time" -n 64
    krafla run --chat smollm -T 0 -p "What is the capital of France?"   # the default model
    echo "Summarise: ..." | krafla run MODEL.mlb -z TOK.mlt --chat qwen

The reply streams to stdout as it is generated; stderr gets a one-line status while a long
prompt runs (on a terminal) and one stats line at the end. With a chat template the prompt is one
user message rendered by it, as the server renders a chat request: --chat names it, else the
tokenizer file's own (krafla convert found it from the model's template; stderr says which).
With `--chat none`, or a file that names none, the prompt is plain text (with BOS if the tokenizer
adds one). Without MODEL the default model is pulled on first use and its own chat template
applies. A prompt read from stdin loses one trailing newline (what echo
adds). Same seed (or -T 0), same options: same output.

Interactive (`-i`, or stdin a terminal without -p): each line is the next user message of one
chat, rendered turn by turn so each turn only evaluates its new tokens.
"""

import sys

from krafla_twisted.chat import templates
from krafla_twisted.cli import options, startup
from krafla_twisted.engine import clib
from krafla_twisted.generation import generate


def add_arguments(parser):
    parser.add_argument("model", nargs="?", metavar="MODEL.mlb",
                        help="model file (default: the default model, pulled and converted on first use)")
    parser.add_argument("-p", "--prompt", help="the prompt (default: read from stdin)")
    parser.add_argument("-i", "--interactive", action="store_true",
                        help="chat turn by turn: each line on stdin is the next user message (the default "
                             "when stdin is a terminal and no -p is given)")
    options.add_arguments(parser, prompt_short_p=True)


def read_prompt(args, stdin):
    if args.prompt is not None:
        return args.prompt
    text = stdin.read()
    return text[:-1] if text.endswith("\n") else text


class PromptStatus:
    """`# prompt 512/2048 tokens` on one rewritten stderr line, only on a terminal."""

    def __init__(self, stream, enabled):
        self.stream = stream
        self.enabled = enabled
        self.shown = False

    def __call__(self, done, total):
        if not self.enabled or total <= 0:
            return
        if done < total:
            self.stream.write(f"\r# prompt {done}/{total} tokens")
            self.stream.flush()
            self.shown = True
        else:
            self.clear()

    def clear(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def stats_line(result, isa=None):
    """`# prompt 12 tokens (0 cached), 250.3 tokens/s; reply 64 tokens, 40.1 tokens/s; length; isa avx512`
    (the ISA of the loaded library, when given; `speculation 30/41 proposed tokens accepted; ` before
    the finish reason when speculation proposed any)."""
    def rate(value):
        return "-" if value == float("inf") else f"{value:.1f}"

    return (f"# prompt {result.prompt_tokens} tokens ({result.cached_tokens} cached), "
            f"{rate(result.prompt_tokens_per_second)} tokens/s; "
            f"reply {result.completion_tokens} tokens, {rate(result.completion_tokens_per_second)} tokens/s; "
            + (f"speculation {result.accepted_tokens}/{result.proposed_tokens} proposed tokens accepted; "
               if result.proposed_tokens else "")
            + f"{result.finish_reason}" + (f"; isa {isa}" if isa else ""))


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class _Output:
    """The reply streamed to stdout, with the prompt status erased first."""

    def __init__(self, stdout, status):
        self.stdout = stdout
        self.status = status
        self.ended_with_newline = True

    def __call__(self, piece):
        self.status.clear()
        self.stdout.write(piece)
        self.stdout.flush()
        self.ended_with_newline = piece.endswith("\n")

    def end_reply(self):
        if not self.ended_with_newline:
            self.stdout.write("\n")
            self.stdout.flush()
        self.ended_with_newline = True


def main(args, stdin=None, stdout=None, stderr=None):
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    # On a terminal without -p: a chat if there is a template, else the prompt up to end of input.
    maybe_interactive = args.prompt is None and _is_terminal(stdin)
    try:
        if not (args.interactive or maybe_interactive):
            prompt = read_prompt(args, stdin)
            if not prompt:
                raise ValueError("the prompt is empty (give -p PROMPT or text on stdin)")
        runtime = startup.load_runtime(args, progress=True)
        if runtime.template is not None and runtime.template_from not in (None, "--chat"):
            print(f"krafla run: chat template {runtime.template.name} (from {runtime.template_from}; "
                  "--chat none for plain text)", file=stderr)
        interactive = args.interactive or (maybe_interactive and runtime.template is not None)
        if maybe_interactive and not interactive:
            prompt = read_prompt(args, stdin)
            if not prompt:
                runtime.close()
                raise ValueError("the prompt is empty (give -p PROMPT or text on stdin)")
    except (ValueError, OSError, clib.KraflaError) as e:
        print(f"krafla run: {e}", file=stderr)
        return 1
    status = PromptStatus(stderr, _is_terminal(stderr))
    output = _Output(stdout, status)
    try:
        with runtime:
            if interactive:
                return _chat_loop(runtime, args.prompt, stdin, output, stderr)
            if runtime.template is not None:
                request = generate.build_prompt(runtime, messages=[{"role": "user", "content": prompt}])
            else:
                request = generate.build_prompt(runtime, text=prompt)
            result = _reply(runtime, request, output)
    except KeyboardInterrupt:
        status.clear()
        print("\nkrafla run: interrupted", file=stderr)
        return 130
    except (ValueError, OSError, clib.KraflaError, templates.ChatError) as e:
        status.clear()
        print(f"krafla run: {e}", file=stderr)
        return 1
    output.end_reply()
    print(stats_line(result, clib.loaded_isa()), file=stderr)
    return 0


def _reply(runtime, prompt, output):
    return generate.Generator(runtime).generate(
        prompt.tokens, max_tokens=runtime.max_tokens, sampling=runtime.sampling, stop_strings=prompt.stop_strings,
        on_text=output, on_prompt_progress=output.status)


def _chat_loop(runtime, first_message, stdin, output, stderr):
    """Each line of stdin is the next user message of one conversation; replies stream to stdout
    and each is followed by its stats line. The conversation is rendered turn by turn, so every
    turn reuses the previous turns' KV cache. Ends at end of input."""
    if runtime.template is None:
        raise ValueError("interactive mode is a chat: give --chat TEMPLATE")
    terminal = _is_terminal(stdin)
    conversation = []
    pending = [first_message] if first_message else []
    while True:
        if pending:
            message = pending.pop()
        else:
            if terminal:
                stderr.write("> ")
                stderr.flush()
            line = stdin.readline()
            if not line:
                return 0
            message = line[:-1] if line.endswith("\n") else line
            if not message.strip():
                continue
        conversation.append({"role": "user", "content": message})
        result = _reply(runtime, generate.build_prompt(runtime, messages=conversation), output)
        conversation.append({"role": "assistant", "content": result.text})
        output.end_reply()
        print(stats_line(result, clib.loaded_isa()), file=stderr)
