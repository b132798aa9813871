"""One table of the options `krafla run` and the server share: model files, chat, engine, sampling.

`ENGINE_OPTIONS` is consumed twice: `add_arguments(parser)` puts it on an argparse parser (for
`krafla run`), `twistd_rows()` turns it into usage.Options optParameters/optFlags (for `twistd
krafla`). Values are read back by `values(opts)` from either (an argparse Namespace, or the
usage.Options mapping keyed by long names), then checked by `validate`.

`-p`: the original's `ml_run` takes the prompt as `-p PROMPT`, and its server takes top-p as
`-p`. Both stay true: the server has `-p`/`--top-p`, `krafla run` has `-p PROMPT` and `--top-p`.
"""

import math
import os
from dataclasses import dataclass

from krafla_twisted.chat.templates import TEMPLATE_NAMES
from krafla_twisted.engine import header
from krafla_twisted.generation.speculate import DEFAULT_SPEC, SPEC_MODES

KV_TYPES = tuple(name.lower() for name in header.members("KR_KV_"))
MAX_THREADS = 256


class OptionError(ValueError):
    """An option value out of range; the message names the option as a user types it."""


def _choice(name, choices):
    def coerce(text):
        if text not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, not {text!r}")
        return text
    coerce.coerceDoc = f"One of {', '.join(choices)}."
    return coerce


def _number(kind, name, low=None, high=None):
    """A converter that also checks the range, so a bad value is refused where it is typed."""
    def coerce(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise ValueError(f"{name} takes {'an integer' if kind is int else 'a number'}, not {text!r}") from None
        _check_range(name, value, low, high)
        return value
    return coerce


def _check_range(name, value, low, high):
    if isinstance(value, float) and not math.isfinite(value):
        raise OptionError(f"{name} must be a finite number, not {value}")
    if low is not None and value < low:
        raise OptionError(f"{name} must be at least {low}, not {value}")
    if high is not None and value > high:
        raise OptionError(f"{name} must be at most {high}, not {value}")


@dataclass(frozen=True)
class Option:
    name: str            # the attribute krafla code reads: values(opts)[name]
    long: str            # --long on the command line; the usage.Options key
    short: str = None    # one letter, or None
    default: object = None
    help: str = ""
    kind: type = str     # str, int or float (the value's type); ignored for flags
    metavar: str = None
    choices: tuple = None
    low: object = None
    high: object = None
    flag: bool = False
    run_short: bool = True  # False: `krafla run` has only the long form (its -p is the prompt)

    @property
    def coerce(self):
        """usage.Options' converter for this parameter (also checks choices and range)."""
        if self.choices:
            return _choice(self.flag_text, self.choices)
        if self.kind in (int, float):
            return _number(self.kind, self.flag_text, self.low, self.high)
        return None

    @property
    def flag_text(self):
        return f"--{self.long}"

    def check(self, value):
        """Raise OptionError if `value` is not acceptable for this option (None is the default)."""
        if value is None or self.flag:
            return
        if self.choices and value not in self.choices:
            raise OptionError(f"{self.flag_text} must be one of {', '.join(self.choices)}, not {value!r}")
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    self.kind is int and not isinstance(value, int)):
                raise OptionError(f"{self.flag_text} takes {'an integer' if self.kind is int else 'a number'}, "
                                  f"not {value!r}")
            _check_range(self.flag_text, value, self.low, self.high)


ENGINE_OPTIONS = (
    Option("tokenizer", "tokenizer", "z", None, "Tokenizer file (.mlt) of the model.", metavar="TOK.mlt"),
    Option("chat", "chat", None, None,
           f"Chat template: {', '.join(TEMPLATE_NAMES)}, or none for plain-text prompts. Without it, the "
           "template the tokenizer file names (krafla convert finds it from the model's own template); "
           "with none there, prompts are plain text.", choices=TEMPLATE_NAMES + ("none",), metavar="TEMPLATE"),
    Option("system", "system", None, None, "System prompt for chats that have none.", metavar="TEXT"),
    Option("threads", "threads", "t", None, "Threads (default: the number of CPUs).", int, "N", low=1, high=MAX_THREADS),
    Option("ctx", "ctx", None, None,
           f"Context length in tokens (default: the model's max_seq, at most {header.KR_DEFAULT_MAX_CTX}).", int, "N", low=1),
    Option("kv", "kv", None, "f32", f"KV cache type: {', '.join(KV_TYPES)}.", choices=KV_TYPES, metavar="TYPE"),
    # 64: the server reads waiting prompts up to 64 tokens a step beside the running replies; against
    # 32 that cut the 8-client p95 time to first token (SmolLM2 925 -> 506 ms), and a running
    # stream's longest pause is half what 128 gives (docs/server.md, "Slots and batching").
    Option("batch", "batch", None, 64, "Prompt tokens per forward step.", int, "N", low=1, high=65536),
    Option("no_pack", "no-pack", None, False, "Run on the file's weight layout (no repacking).", flag=True),
    Option("pack_cache", "pack-cache", None, False,
           "Keep repacked weights in a file beside the model so the next start is fast.", flag=True),
    Option("mlock", "mlock", None, False,
           "Lock the loaded model in RAM (mlockall) so its weights are never paged out.", flag=True),
    Option("eos", "eos", None, None, "Token id that ends a reply, instead of the tokenizer's.", int, "ID", low=0),
    Option("temperature", "temperature", "T", 0.0, "Sampling temperature; 0 is greedy.", float, "X", low=0.0),
    Option("top_p", "top-p", "p", 0.9, "Top-p (nucleus) sampling; 1 is off.", float, "X", low=0.0, high=1.0,
           run_short=False),
    Option("top_k", "top-k", None, 0, "Top-k sampling; 0 is off.", int, "N", low=0, high=2**31 - 1),
    Option("min_p", "min-p", None, 0.0, "Min-p sampling: drop tokens less likely than this times the best one; 0 is off.",
           float, "X", low=0.0, high=1.0),
    Option("repeat_penalty", "repeat-penalty", None, 1.0,
           "Penalty for tokens among the last --repeat-last-n; 1 is off.", float, "X", low=1e-6),
    Option("repeat_last_n", "repeat-last-n", None, 64, "Tokens the repeat penalty looks back on (-1: all).",
           int, "N", low=-1, high=2**31 - 1),
    Option("frequency_penalty", "frequency-penalty", None, 0.0,
           "Subtract this times a token's count among the last --repeat-last-n (OpenAI's); 0 is off.", float, "X",
           low=-2.0, high=2.0),
    Option("presence_penalty", "presence-penalty", None, 0.0,
           "Subtract this from every token among the last --repeat-last-n (OpenAI's); 0 is off.", float, "X",
           low=-2.0, high=2.0),
    Option("seed", "seed", "s", None, "Random seed (default: a new one for every reply).", int, "N",
           low=0, high=2**64 - 1),
    Option("max_tokens", "max-tokens", "n", 0, "Reply tokens at most; 0 runs until the context is full.",
           int, "N", low=0),
    Option("spec", "spec", None, DEFAULT_SPEC,
           "Speculative decoding: lookup proposes the continuation of an earlier match of the last tokens "
           "in the prompt and reply, checked in one forward step (the reply is the same bits); none is off.",
           choices=SPEC_MODES, metavar="MODE"),
    Option("draft", "draft", None, None,
           "A smaller model with the same tokenizer (.mlb) that proposes the tokens instead of --spec lookup.",
           metavar="DRAFT.mlb"),
    Option("draft_tokenizer", "draft-tokenizer", None, None,
           "The draft model's tokenizer (default: DRAFT.mlt beside DRAFT.mlb), checked to be the model's.",
           metavar="TOK.mlt"),
)

BY_NAME = {option.name: option for option in ENGINE_OPTIONS}


def add_arguments(parser, *, prompt_short_p=True):
    """Put every option on an argparse parser. With prompt_short_p (`krafla run`), top-p has
    only its long form because -p is the prompt there."""
    group = parser.add_argument_group("model, engine and sampling")
    for option in ENGINE_OPTIONS:
        flags = [f"--{option.long}"]
        if option.short and (option.run_short or not prompt_short_p):
            flags.insert(0, f"-{option.short}")
        if option.flag:
            group.add_argument(*flags, dest=option.name, action="store_true", help=option.help)
            continue
        group.add_argument(*flags, dest=option.name, default=option.default, metavar=option.metavar,
                           type=_argparse_type(option.coerce) if option.coerce else str, help=option.help)
    return group


def _argparse_type(coerce):
    """argparse shows only ArgumentTypeError messages; ours name the option and the limit."""
    import argparse

    def convert(text):
        try:
            return coerce(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def twistd_rows():
    """(optParameters, optFlags) for a twisted.python.usage.Options subclass."""
    parameters, flags = [], []
    for option in ENGINE_OPTIONS:
        if option.flag:
            flags.append([option.long, option.short, option.help])
        else:
            parameters.append([option.long, option.short, option.default, option.help, option.coerce])
    return parameters, flags


def values(opts):
    """{name: value} for every option, from an argparse Namespace or a usage.Options mapping
    (keyed by long names; missing keys take the default)."""
    out = {}
    for option in ENGINE_OPTIONS:
        if hasattr(opts, "keys"):
            value = opts.get(option.long, opts.get(option.name, option.default))
        else:
            value = getattr(opts, option.name, option.default)
        out[option.name] = bool(value) if option.flag else value
    return out


def validate(option_values):
    """Check every value (as `values` returns them); OptionError names the first bad one."""
    for name, value in option_values.items():
        if name in BY_NAME:
            BY_NAME[name].check(value)
    return option_values


def default_threads():
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))
