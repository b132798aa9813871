"""The chat template from the model's own file.

A GGUF carries its Jinja chat template in `tokenizer.chat_template`, a Hugging Face folder in
tokenizer_config.json's `chat_template` (or a chat_template.jinja beside it). krafla does not run
Jinja when it serves: the converter decides here, once, which built-in template
(krafla_twisted.chat.templates) the model's template is, by rendering both on a set of conversations and
comparing the texts, and stores the name (and the original text) in the `.mlt`:

    chat_template          the built-in template's name, when one renders like the model's own
    chat_template_jinja    the model's Jinja text, as the source had it
    chat_template_from     how the name was found: `jinja` (rendered and compared) or
                           `vocabulary` (no template in the source; the vocabulary's turn markers
                           belong to exactly one format, e.g. Gemma's <start_of_turn>)

The server and `krafla run` use `chat_template` when --chat is not given (and say so at start).
"""

import json
import time

from krafla_twisted.chat import templates
from krafla_twisted.engine.container import TOKENIZER_MAGIC, ContainerFile

# Conversations both renderings must agree on (with the generation prompt). Together they tell
# apart templates that differ only in a default system prompt (qwen, smollm vs chatml), in the
# reasoning kept after the last user query (qwen3 vs chatml), in trimming or thinking prompts.
PROBES = (
    [{"role": "user", "content": "Hello! Who are you?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>A greeting.</think>Hello."},
     {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Check the weather"},
     {"role": "assistant", "content": "<think>I should look.</think>Looking."},
     {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}],
)

# Vocabulary markers that only one built-in format uses, for sources without a template.
VOCABULARY_MARKERS = {
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "phi3": ("<|user|>", "<|assistant|>", "<|end|>"),
}


class TemplateFileError(ValueError):
    """A model's Jinja template that cannot be compiled."""


def _environment():
    """Jinja as Hugging Face's apply_chat_template sets it up (sandboxed, trim_blocks,
    lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception). strftime_now is
    left undefined, so templates that print today's date fall back to their fixed one (a template
    that needs it is probed again with it: matching_templates)."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _probe_renderings(compiled, bos_token, eos_token, **variables):
    """The model's template's text of each probe, None where it refuses it."""
    theirs = []
    for messages in PROBES:
        try:
            theirs.append(compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                          eos_token=eos_token, **variables))
        except Exception:  # noqa: BLE001 - any failure of the model's template is a refusal of this probe
            theirs.append(None)
    return theirs


def matching_templates(jinja_text, bos_token="", eos_token=""):
    """The names of the built-in templates that render exactly as `jinja_text` does every probe
    conversation the model's template accepts, at least two of them, and that refuse none of
    those (a built-in template may accept more: Gemma 2's refuses system messages, krafla's gemma
    folds them into the first user turn as Gemma 3's does)."""
    import jinja2

    try:
        compiled = _environment().from_string(jinja_text)
    except jinja2.exceptions.TemplateError as e:
        raise TemplateFileError(f"the model's chat template does not compile: {e}") from None
    theirs = _probe_renderings(compiled, bos_token, eos_token)
    if all(text is None for text in theirs):
        # a template that needs today's date (gpt-oss calls strftime_now unguarded): give it one,
        # the local date as krafla's template writes it
        theirs = _probe_renderings(compiled, bos_token, eos_token, strftime_now=time.strftime)
    if all(text is None for text in theirs):
        return []
    names = []
    for name in templates.TEMPLATE_NAMES:
        template = templates.get_template(name)
        agreed = 0
        for messages, text in zip(PROBES, theirs):
            if text is None:
                continue
            try:
                ours = template.render_text(messages)
            except templates.ChatError:
                break
            if ours != text:
                break
            agreed += 1
        else:
            if agreed >= 2:
                names.append(name)
    return names


def _spelling(container, token_id):
    if token_id is None or token_id < 0:
        return ""
    offsets = container.array("token_offsets")
    text = container.array("token_text")
    return bytes(text[offsets[token_id]:offsets[token_id + 1]]).decode("utf-8", "replace")


def _spellings(container):
    offsets = container.array("token_offsets")
    text = bytes(container.array("token_text"))
    return {text[offsets[i]:offsets[i + 1]].decode("utf-8", "replace") for i in range(len(offsets) - 1)}


def choose(container, jinja_text):
    """(name or None, how, message) for the tokenizer container `container` (a .mlt being
    written) and the source's Jinja template (None when it has none)."""
    if jinja_text:
        meta = container.metadata
        names = matching_templates(jinja_text, _spelling(container, meta.get("bos_id")),
                                   _spelling(container, meta.get("eos_id")))
        if names:
            return names[0], "jinja", f"chat template: {names[0]} (renders like the model's own template)"
        return None, "jinja", ("chat template: the model's own template is none of krafla's "
                               f"({', '.join(templates.TEMPLATE_NAMES)}); give --chat NAME when serving it")
    spellings = _spellings(container)
    found = [name for name, markers in VOCABULARY_MARKERS.items() if all(m in spellings for m in markers)]
    if len(found) == 1:
        markers = "/".join(VOCABULARY_MARKERS[found[0]][:2])
        return found[0], "vocabulary", (f"chat template: {found[0]} (the source has no template; its vocabulary's "
                                        f"turn markers {markers} are that format's)")
    return None, None, "chat template: none in the source; give --chat NAME when serving it"


def store(container, jinja_text):
    """Record the chosen template (and the original text) in the tokenizer container's metadata;
    returns the message saying what was chosen."""
    name, how, message = choose(container, jinja_text)
    if jinja_text:
        container.metadata["chat_template_jinja"] = jinja_text
    if name is not None:
        container.metadata["chat_template"] = name
        container.metadata["chat_template_from"] = how
    return message


def jinja_of(mlt_path):
    """The model's own Jinja chat template a .mlt keeps (chat_template_jinja), or None."""
    with ContainerFile(mlt_path, magic=TOKENIZER_MAGIC) as file:
        text = file.metadata.get("chat_template_jinja")
    return text if isinstance(text, str) else None


def template_of(mlt_path):
    """The chat template name a .mlt records, or None; clib.KraflaError for an unreadable file.
    A name this krafla does not know (a newer converter's) is an error naming --chat."""
    with ContainerFile(mlt_path, magic=TOKENIZER_MAGIC) as file:
        name = file.metadata.get("chat_template")
    if name is None:
        return None
    if name not in templates.TEMPLATE_NAMES:
        raise templates.ChatError(f"{mlt_path}: the tokenizer file names chat template {name!r}, which this krafla "
                             f"does not know; give --chat with one of {', '.join(templates.TEMPLATE_NAMES)}")
    return name
