"""The served model as the HTTP layer sees it: krafla_twisted.generation.generate's Runtime and Generator.

The rendering of chats (krafla_twisted.chat.templates), tokenizing, KV-cache reuse, sampling, stop strings and
UTF-8 pieces all live in generate/chat; this module only maps a validated request onto them and
their errors onto OpenAI's. It is the API's one way to the engine: nothing else under api/ imports
the engine, the tokenizer or the C library.

`begin` (a completion for the scheduler), `complete` (one alone), `tokenize` and `detokenize` run
in the worker thread only, like everything that touches
the Runtime. The plain attributes (model_id, n_vocab, n_ctx, has_chat) are fixed at load and read by
the I/O thread.
"""

import contextlib
import dataclasses
import os

from krafla_twisted import __version__
from krafla_twisted.api.errors import ContextTooLong, InvalidRequest, Unsupported
from krafla_twisted.chat import template_file, templates
from krafla_twisted.generation import gbnf, generate, grammar, tools
from krafla_twisted.generation.scheduler import Pending, Scheduler


class Backend:
    def __init__(self, runtime, *, model_id):
        self.runtime = runtime
        self.scheduler = Scheduler(runtime)   # the worker steps it: --parallel replies side by side
        self.model_id = model_id
        self.template = runtime.template
        self.tokenizer = runtime.tokenizer
        self.n_vocab = self.tokenizer.n_vocab
        self.n_ctx = runtime.n_ctx
        self.has_chat = self.template is not None
        # the template's native tool format, else the generic one (tools in the system prompt, replies as JSON)
        tool_format = getattr(self.template, "tool_format", None) or "generic"
        self.tool_format = tools.FORMATS[tool_format] if self.has_chat else None
        # whether the vocabulary has fill-in-the-middle tokens (a request's `suffix`)
        self.fills_in = generate.fim_token_ids(self.tokenizer) is not None
        self._tokenizer_info = None   # GET /tokenizer_info's answer, made on its first request

    @classmethod
    def serving(cls, runtime, alias=None):
        """The Backend of a loaded Runtime; its model id is `alias`, or the model file's name without .mlb."""
        return cls(runtime, model_id=alias or file_stem(runtime.model.path))

    def banner(self):
        """`# krafla 0.7.0, isa avx2: model NAME, context N of M, chat T, threads N, kv f32, parallel P
        (KV cache P x S MiB)`; T is followed by where it came from when --chat did not name it
        (`smollm (from the tokenizer file)`)."""
        model = self.runtime.model
        slot_bytes = self.runtime.kv_bytes_per_slot
        template = self.template.name if self.template is not None else "none"
        source = getattr(self.runtime, "template_from", None)
        if source and source != "--chat":
            template += f" (from {source})"
        return (
            f"# krafla {__version__}, isa {self.runtime.isa}: model {file_stem(model.path)}, context {self.n_ctx} "
            f"of {model.max_seq}, chat {template}, threads {self.runtime.threads}, kv {self.runtime.kv}, "
            f"parallel {self.runtime.parallel} (KV cache {self.runtime.parallel} x {slot_bytes / 2**20:.1f} MiB)"
        )

    def prompt(self, completion):
        """The request's generate.Prompt (token ids and stop strings), built as `krafla run` builds its own."""
        if completion.kind == "chat":
            # the generic format leaves the tools out of the prompt when tool_choice is "none"
            leave_out = completion.tool_choice == "none" and getattr(self.tool_format, "constrains_text", False)
            return generate.build_prompt(self.runtime, messages=completion.messages, stop=completion.stop,
                                         tools=None if leave_out else completion.tools or None)
        if completion.suffix is not None:  # fill in the middle
            return generate.build_prompt(self.runtime, infill=(completion.prompt_text, completion.suffix),
                                         stop=completion.stop)
        if completion.prompt_tokens is not None:
            return generate.build_prompt(self.runtime, tokens=completion.prompt_tokens, stop=completion.stop)
        return generate.build_prompt(self.runtime, text=completion.prompt_text, stop=completion.stop)

    def sampling(self, overrides, choice=0):
        """The server's default SamplingParams (its -T, -p, ... options) with the request's fields over them;
        the `choice`th of a request's n replies samples with the seed plus `choice` (so they differ, and a
        seeded request repeats all of them)."""
        changes = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)}
        sampling = dataclasses.replace(self.runtime.sampling, **{k: v for k, v in changes.items() if v is not None})
        if choice and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + choice) % 2**64)
        return sampling

    def logit_bias(self, completion):
        """The request's logit_bias, with the end-of-reply tokens banned when it asks to ignore them
        (as llama-server does for ignore_eos: the reply runs to max_tokens, a stop string or the context)."""
        if not completion.ignore_eos:
            return completion.logit_bias
        return {**completion.logit_bias, **{int(token): -100 for token in self.runtime.stop_token_ids}}

    def token_pieces(self, tokens):
        """Each token's bytes, in order."""
        return [self.tokenizer.token_bytes(token) for token in tokens]

    def logprob_pieces(self, entries):
        """TokenLogprobs with each token as its bytes: (bytes, logprob, ((bytes, logprob), ...))."""
        piece = self.tokenizer.token_bytes
        return tuple((piece(e.token), e.logprob, tuple((piece(t), value) for t, value in e.top)) for e in entries)

    def constraint(self, completion):
        """(the grammar.Constraint a request's response_format or tool_choice asks for, or None;
        whether the whole reply is JSON that Constraint.close_within may close).
        This must be called in the worker thread (a tokenizer's first grammar builds its vocabulary)."""
        if completion.requires_call:
            only = None if completion.tool_choice == "required" else completion.tool_choice
            # Qwen3.5's generation prompt leaves the reply inside a think block: reasoning comes first
            # (gpt-oss's harmony format grammar has none: its reasoning is a channel).
            thinking = bool(getattr(self.template, "thinking", False))
            text = self.tool_format.grammar(completion.tools, only=only, parallel=completion.parallel_tool_calls,
                                            thinking=thinking)
            return self._constraint(grammar.lark_grammar(text), "tools"), not thinking
        if completion.grammar is not None:
            try:
                source = grammar.lark_grammar(gbnf.to_lark(completion.grammar))
            except (grammar.GrammarError, ValueError) as e:
                raise InvalidRequest(f"'grammar' cannot be used: {e}", param="grammar") from None
            return self._constraint(source, "grammar"), False
        if completion.response_format is not None:
            param = "response_format"
            if completion.response_format["type"] == "json_object":
                return self._json_object_constraint(completion), True
            try:
                source = grammar.json_schema_grammar(completion.response_format["schema"])
            except grammar.GrammarError as e:
                raise InvalidRequest(str(e), param=param) from None
            return self._constraint(source, param), True
        if completion.tools and completion.tool_choice == "auto" and getattr(self.tool_format, "constrains_text", False):
            # the generic format: the reply is a plain text or a call
            text = self.tool_format.grammar(completion.tools, parallel=completion.parallel_tool_calls, text=True)
            return self._constraint(grammar.lark_grammar(text), "tools"), False
        return None, False

    def _json_object_constraint(self, completion):
        """json_object: an object valid against the JSON schema of an object that the system or user
        messages write (as instructor's JSON mode and pydantic-ai's prompted output put it there), or
        any object when they write none or it cannot be used (docs/api.md, "Structured output")."""
        texts = [m["content"] for m in completion.messages if m["role"] in ("system", "developer", "user")]
        found = grammar.schema_in_texts(texts)
        if found is not None:
            try:
                return self._constraint(grammar.json_schema_grammar(found), "response_format")
            except (grammar.GrammarError, InvalidRequest):
                pass   # the prompt's schema is a hint the client did not send as one: fall back to any object
        return self._constraint(grammar.json_schema_grammar({"type": "object"}), "response_format")

    def _constraint(self, source, param):
        try:
            vocabulary = grammar.Vocabulary.of(self.tokenizer, self.runtime.stop_token_ids)
            return grammar.Constraint(vocabulary, source)
        except grammar.GrammarError as e:
            raise InvalidRequest(f"'{param}' cannot be used: {e}", param=param) from None

    def begin(self, completion, on_text, cancelled, on_logprobs=None):
        """A validated request as a scheduler.Pending: its generate.Generation (prompt rendered, grammar
        built), and how its result becomes the reply's. This must be called in the worker thread."""
        param = "messages" if completion.kind == "chat" else "prompt"
        try:
            prompt = self.prompt(completion)
        except templates.ChatError as e:
            no_format = completion.kind == "chat" and completion.tools and self.tool_format is None
            raise InvalidRequest(str(e), param="tools" if no_format else param) from None
        except generate.NoFillInTheMiddle as e:
            raise Unsupported(f"'suffix' cannot be used: {e}", param="suffix") from None
        except ValueError as e:  # an empty prompt, a token id the engine refuses
            raise InvalidRequest(str(e), param=param) from None
        constraint, closes = self.constraint(completion)
        echo = Echo(self, completion, prompt.tokens) if completion.echo else None
        if echo is not None and on_text is not None:
            on_text, on_logprobs = echo.streaming(on_text, on_logprobs)
        if on_logprobs is not None:
            streamed, on_logprobs = on_logprobs, lambda entries: streamed(self.logprob_pieces(entries))
        max_tokens = completion.max_tokens if completion.max_tokens is not None else self.runtime.max_tokens
        with self._request_errors(completion):
            generation = generate.Generation(
                self.runtime,
                prompt.tokens,
                max_tokens=max_tokens,
                sampling=self.sampling(completion.sampling, completion.choice),
                stop_strings=prompt.stop_strings,
                on_text=on_text,
                cancelled=cancelled,
                constraint=constraint,
                logit_bias=self.logit_bias(completion),
                logprobs=completion.logprobs,
                on_logprobs=on_logprobs,
                prompt_logprobs=completion.logprobs if echo is not None else None,
                reply=echo is None or completion.max_tokens != 0,
            )
        if echo is not None:
            echo.generation = generation
        if closes:
            constraint.close_within(generation.limit)

        def conclude(finished):
            with self._request_errors(completion):
                if finished.error is not None:
                    raise finished.error
                result = finished.result
                if completion.logprobs is not None:
                    result = dataclasses.replace(result, logprobs=self.logprob_pieces(result.logprobs))
                return echo.conclude(result) if echo is not None else result

        return Pending(generation, conclude)

    def complete(self, completion, on_text, cancelled, on_logprobs=None):
        """Generate the reply for a validated request, alone. This must be called in the worker thread."""
        pending = self.begin(completion, on_text, cancelled, on_logprobs)
        try:
            generate.run_alone(pending.generation)
        except Exception as e:
            pending.generation.fail(e)
        return pending.conclude(pending.generation)

    @contextlib.contextmanager
    def _request_errors(self, completion):
        """The engine's and the grammar's errors as the request's (OpenAI-shaped) errors."""
        param = "messages" if completion.kind == "chat" else "prompt"
        try:
            yield
        except generate.ContextLengthExceeded as e:
            raise ContextTooLong(str(e), param=param) from None
        except grammar.GrammarError as e:
            param = "tools" if completion.requires_call or completion.response_format is None else "response_format"
            raise InvalidRequest(f"the reply's grammar failed: {e}", param=param) from None
        except ValueError as e:
            # The request was validated; what the renderer or the engine still refuses (a chat the template
            # cannot render, a token id, an empty prompt) is the request's.
            raise InvalidRequest(str(e), param=param) from None

    def tokenize(self, content, *, add_special, parse_special, with_pieces):
        """/tokenize's answer. This must be called in the worker thread."""
        return tokenize(self.tokenizer, content, add_special=add_special, parse_special=parse_special,
                        with_pieces=with_pieces)

    def detokenize(self, tokens):
        """/detokenize's answer. This must be called in the worker thread."""
        return detokenize(self.tokenizer, tokens)

    def tokenizer_info(self):
        """GET /tokenizer_info's answer, as vLLM gives it (lm-evaluation-harness's remote tokenizer reads
        it): the end and start tokens as spelled, whether a BOS is added, the context, and the model's
        own Jinja chat template when its tokenizer file keeps one (the built-in template krafla
        renders with was chosen at conversion to render the same). Worker thread only; made on the
        first call (the template is read from the file) and kept, as nothing in it changes."""
        if self._tokenizer_info is None:
            tokenizer = self.tokenizer

            def spelled(token):
                return None if token is None else tokenizer.token_bytes(token).decode("utf-8", "replace")

            path = getattr(tokenizer, "path", None)
            self._tokenizer_info = {
                "tokenizer_class": "krafla", "eos_token": spelled(tokenizer.eos_id), "bos_token": spelled(tokenizer.bos_id),
                "pad_token": None, "add_bos_token": bool(tokenizer.add_bos), "model_max_length": self.n_ctx,
                "chat_template": template_file.jinja_of(path) if path else None}
        return self._tokenizer_info


class Echo:
    """A text completion's `echo`: the reply comes after the prompt, and with `logprobs` each prompt
    token has its own (the log probability the model gives it after the tokens before it; the
    first has none, null in the reply, unless a BOS the tokenizer added precedes it, which is not
    echoed: the echo is the prompt as sent). The echoed text is those tokens' text, so that
    `text_offset` points into it. Worker thread only."""

    def __init__(self, backend, completion, prompt_ids):
        tokenizer = backend.tokenizer
        self.backend = backend
        self.logprobs = completion.logprobs
        # a text prompt gets the tokenizer's BOS first; token ids are the prompt as given
        added = completion.prompt_tokens is None and tokenizer.add_bos and tokenizer.bos_id is not None \
            and prompt_ids[:1] == (tokenizer.bos_id,)
        self.skip = 1 if added else 0
        self.ids = prompt_ids[self.skip:]
        self.text = tokenizer.decode(self.ids, special=True).decode("utf-8", "replace")
        self.generation = None   # set once made: its prompt entries are read when the prompt is in
        self.sent = False        # streamed: the echo went out before the reply's first text
        self.on_text = self.on_logprobs = None   # streamed: where the echo goes (Echo.streaming)

    def entries(self):
        """(bytes, logprob, top) of each echoed token; the first token scored after nothing is
        (bytes, None, None)."""
        entries = list(self.backend.logprob_pieces(self.generation.prompt_entries))
        if not self.skip:   # after an added BOS, the first echoed token's entry is the first scored
            entries.insert(0, (self.backend.tokenizer.token_bytes(self.ids[0]), None, None))
        return entries

    def streaming(self, on_text, on_logprobs):
        """The Generation's on_text and on_logprobs for a streamed reply: the echo (its text, and
        with logprobs its entries) goes before the reply's first piece."""
        def text(piece):
            if not self.sent:
                self.sent = True
                piece = self.text + piece
            on_text(piece)

        def logprobs(entries):
            if not self.sent:
                entries = tuple(self.entries()) + tuple(entries)
            on_logprobs(entries)

        self.on_text, self.on_logprobs = on_text, on_logprobs
        return text, (logprobs if on_logprobs is not None else None)

    def conclude(self, result):
        """The result with the echo before the reply (streamed: sent now, if no piece took it)."""
        if self.on_text is not None:
            if not self.sent:
                self.sent = True
                if self.on_logprobs is not None:
                    self.on_logprobs(tuple(self.entries()))
                self.on_text(self.text)
            return result
        logprobs = tuple(self.entries()) + result.logprobs if self.logprobs is not None else result.logprobs
        return dataclasses.replace(result, text=self.text + result.text, logprobs=logprobs)


def tokenize(tokenizer, content, *, add_special, parse_special, with_pieces):
    """{"tokens": ids} or, with_pieces, {"tokens": [{"id", "piece"}]}: a piece that is not whole UTF-8
    is the list of its byte values, as llama-server gives it."""
    ids = tokenizer.encode(content, add_bos=None if add_special else False, special=parse_special)
    if not with_pieces:
        return {"tokens": ids}
    pieces = []
    for token_id in ids:
        raw = tokenizer.token_bytes(token_id)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": token_id, "piece": piece})
    return {"tokens": pieces}


def detokenize(tokenizer, tokens):
    """{"content": the text of `tokens`} (bytes that are not UTF-8 become U+FFFD)."""
    text = tokenizer.decode(tokens).decode("utf-8", "replace")
    return {"content": text, "prompt": text}   # llama-server's name, and vLLM's


def file_stem(path):
    return os.path.splitext(os.path.basename(os.fspath(path)))[0]
