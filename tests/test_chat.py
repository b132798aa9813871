"""Chat templates: krafla's renderer against the official Jinja templates run by jinja2, and
the turn-by-turn token invariant.

The Jinja environment is set up as Hugging Face's apply_chat_template sets it up (sandboxed,
trim_blocks, lstrip_blocks, loopcontrols, a tojson filter that does not escape HTML,
raise_exception). A conversation ending with a user message is compared with
add_generation_prompt=True; one ending with an assistant message with HF's
continue_final_message rule (render closed, then cut after the final message's content).
"""

import json
import pathlib
import time

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krafla_twisted.chat import templates

# ------------------------------------------------------------------------------------------
# Jinja, as Hugging Face runs chat templates


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def jinja_environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = time.strftime  # transformers' global (gpt-oss's date), local time as krafla's
    return env


# Published formats without an official file in tests/data/templates, written from their model cards.
ZEPHYR_JINJA = (  # TinyLlama-1.1B-Chat-v1.0
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}")
LLAMA2_JINJA = (  # Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")
CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

OFFICIAL = {
    # krafla name: (template file or source, extra variables, system allowed, tail after a closed assistant)
    "llama3": ("meta-llama-Llama-3.1-8B-Instruct.jinja", {"bos_token": "<|begin_of_text|>"}, True, "<|eot_id|>"),
    "qwen": ("Qwen-Qwen2.5-7B-Instruct.jinja", {}, True, "<|im_end|>\n"),
    "smollm": ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", {}, True, "<|im_end|>\n"),
    "gemma": ("google-gemma-2-2b-it.jinja", {"bos_token": "<bos>"}, False, "<end_of_turn>\n"),
    "qwen3.5": ("Qwen3.5-4B.jinja", {}, True, "<|im_end|>\n"),
    "qwen3.5-nothink": ("Qwen3.5-4B.jinja", {"enable_thinking": False}, True, "<|im_end|>\n"),
    "zephyr": (ZEPHYR_JINJA, {"eos_token": "</s>"}, True, "</s>\n"),
    "llama2": (LLAMA2_JINJA, {"bos_token": "<s>", "eos_token": "</s>"}, True, " </s>"),
    "chatml": (CHATML_JINJA, {}, True, "<|im_end|>\n"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", {}, True, "<|im_end|>\n"),
    "qwen3-nothink": ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, True, "<|im_end|>\n"),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", {"bos_token": "<s>", "eos_token": "</s>"}, True,
                "</s>"),
    "phi3": ("microsoft-Phi-3.5-mini-instruct.jinja", {"eos_token": "<|endoftext|>"}, True,
             "<|end|>\n<|endoftext|>"),
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", {}, True, "<|im_end|>\n"),
    "smollm3-nothink": ("HuggingFaceTB-SmolLM3-3B.jinja", {"enable_thinking": False}, True, "<|im_end|>\n"),
    "gpt-oss": ("openai-gpt-oss-20b.jinja", {}, True, "<|return|>"),
}
# Templates whose official form rewrites earlier turns when a new one comes (the reasoning of
# earlier Qwen turns is dropped, Mistral moves the system message to the last user message):
# their turn N+1 does not start with turn N's prompt.
REWRITES_EARLIER_TURNS = ("qwen3.5", "qwen3.5-nothink", "qwen3", "qwen3-nothink", "mistral", "gpt-oss")
REPO_TEMPLATES = pathlib.Path(__file__).resolve().parent / "data" / "templates"


def official_template(testdata, name):
    """An official template from the test data, else from the repository's tests/data/templates."""
    path = testdata / "templates" / name
    return path if path.exists() else REPO_TEMPLATES / name


@pytest.fixture(scope="module")
def official(testdata):
    env = jinja_environment()
    compiled = {}
    for name, (source, variables, system_allowed, tail) in OFFICIAL.items():
        if source.endswith(".jinja"):
            source = official_template(testdata, source).read_text()
        compiled[name] = (env.from_string(source), variables, system_allowed, tail)
    return compiled


def jinja_render(official, name, messages):
    """The official rendering: with the generation prompt after a user turn; after an assistant
    turn, the closed rendering cut right after that message's content (before the template's
    closing text, `tail`). That is HF's continue_final_message, minus its whitespace guesswork:
    HF searches for the message's stripped text and may keep or drop surrounding whitespace
    depending on what it finds; krafla continues the content exactly as the template writes it."""
    template, variables, _, tail = official[name]
    if messages[-1]["role"] != "assistant":
        return template.render(messages=messages, add_generation_prompt=True, **variables)
    closed = template.render(messages=messages, add_generation_prompt=False, **variables)
    assert closed.endswith(tail)
    return closed[:-len(tail)]


def hf_continue_final_message(closed, final):
    """Hugging Face's rule, for the plain case check below."""
    location = closed.rindex(final.strip())
    if closed[location:location + len(final.lstrip())] == final:
        return closed[:location + len(final.lstrip())]
    return closed[:location + len(final.strip())]


# ------------------------------------------------------------------------------------------
# Conversations

MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|eot_id|>", "<start_of_turn>", "[INST]",
           "<<SYS>>", "</s>", "<s>", "<|user|>", "<tool_response>", "<|start|>", "<|message|>", "<|channel|>"]
pieces = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12),
    st.text(" \n\t", min_size=1, max_size=3),
    st.sampled_from(MARKERS),
)
contents = st.lists(pieces, max_size=5).map("".join)


@st.composite
def conversations(draw, system_allowed=True):
    """Alternating user/assistant turns starting with a user, maybe a leading system message;
    ends with a user message (generation prompt) or an assistant one (continued)."""
    messages = []
    if system_allowed and draw(st.booleans()):
        messages.append({"role": "system", "content": draw(contents)})
    n_turns = draw(st.integers(1, 7))
    for index in range(n_turns):
        role = "user" if index % 2 == 0 else "assistant"
        messages.append({"role": role, "content": draw(contents)})
    return messages


# ------------------------------------------------------------------------------------------
# Text against the official templates


class OfficialTemplateTests:
    @pytest.mark.parametrize("name", list(OFFICIAL))
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def test_render_text_equals_jinja(self, official, name, data):
        """render_text equals the official Jinja template's text for system or not, 1-7 turns,
        generation prompt or a continued final assistant message, odd whitespace and marker text."""
        messages = data.draw(conversations(system_allowed=official[name][2]))
        assert templates.get_template(name).render_text(messages) == jinja_render(official, name, messages)

    @pytest.mark.parametrize("name", list(OFFICIAL))
    def test_continue_agrees_with_hugging_face(self, official, name):
        """For a final message without surrounding whitespace, the continuation is exactly what
        HF's apply_chat_template(continue_final_message=True) gives."""
        template, variables, _, _ = official[name]
        messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "I pick"}]
        closed = template.render(messages=messages, add_generation_prompt=False, **variables)
        assert templates.get_template(name).render_text(messages) == hf_continue_final_message(closed, "I pick")

    @pytest.mark.parametrize("name", [name for name, (_, _, system, _) in OFFICIAL.items() if system])
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def test_system_argument_is_a_leading_system_message(self, official, name, data):
        """system= renders as if the conversation began with that system message (every official
        template here but gemma-2's takes one)."""
        messages = data.draw(conversations(system_allowed=False))
        system = data.draw(contents)
        expected = jinja_render(official, name, [{"role": "system", "content": system}] + messages)
        assert templates.get_template(name).render_text(messages, system=system) == expected

    @pytest.mark.parametrize("name", templates.TEMPLATE_NAMES)
    def test_conversation_system_wins_over_argument(self, name):
        """A system message in the conversation is used and system= is ignored."""
        template = templates.get_template(name)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert template.render_text(messages, system="Ignored") == template.render_text(messages)
        assert "Ignored" not in template.render_text(messages, system="Ignored")


class PublishedFormatTests:
    def test_chatml(self):
        """chatml, written out: system, user, assistant, user, then the generation prompt."""
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
        assert templates.get_template("chatml").render_text(messages) == (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n")

    def test_zephyr(self):
        """zephyr (TinyLlama chat), written out."""
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
        assert templates.get_template("zephyr").render_text(messages) == (
            "<|system|>\nS</s>\n<|user|>\nU1</s>\n<|assistant|>\nA1</s>\n<|user|>\nU2</s>\n<|assistant|>\n")

    def test_llama2(self):
        """llama2 (Llama-2-chat), written out: the system prompt inside the first [INST]."""
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
        assert templates.get_template("llama2").render_text(messages) == (
            "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST]")

    def test_qwen_default_system(self):
        """qwen without a system message uses Qwen2.5's own default system prompt."""
        text = templates.get_template("qwen").render_text([{"role": "user", "content": "Hi"}])
        assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    def test_qwen35_generation_prompts(self):
        """qwen3.5 opens a think block; qwen3.5-nothink closes an empty one."""
        messages = [{"role": "user", "content": "Hi"}]
        assert templates.get_template("qwen3.5").render_text(messages).endswith("<|im_start|>assistant\n<think>\n")
        assert templates.get_template("qwen3.5-nothink").render_text(messages).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


class GemmaSystemTests:
    def test_system_goes_before_first_user_message(self):
        """gemma folds the system prompt into the first user turn, as Gemma 3's template does."""
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": " U "}]
        assert templates.get_template("gemma").render_text(messages) == (
            "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n")
        assert templates.get_template("gemma").render_text(messages[1:], system="S") == (
            "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n")


class MessageTests:
    def test_developer_is_system(self):
        """A developer message renders exactly as a system message."""
        for name in templates.TEMPLATE_NAMES:
            template = templates.get_template(name)
            as_system = [{"role": "system", "content": "Rules"}, {"role": "user", "content": "Hi"}]
            as_developer = [{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Hi"}]
            assert template.render_text(as_developer) == template.render_text(as_system), name

    def test_content_parts_are_joined(self):
        """A list of text parts renders as the concatenation of their texts."""
        template = templates.get_template("chatml")
        parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]}]
        assert template.render_text(parts) == template.render_text([{"role": "user", "content": "Hello, you"}])

    @pytest.mark.parametrize("messages, fragment", [
        ([], "empty"),
        ("hi", "list"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text"),
        (["hello"], "object"),
    ])
    def test_bad_messages(self, messages, fragment):
        """Malformed conversations raise ChatError (a ValueError) naming the problem."""
        with pytest.raises(templates.ChatError, match=fragment):
            templates.get_template("chatml").render_text(messages)

    def test_system_in_the_middle(self):
        """Templates with a system turn render a later system message in place; the others refuse it."""
        messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                    {"role": "user", "content": "c"}]
        assert "<|im_start|>system\nb<|im_end|>" in templates.get_template("chatml").render_text(messages)
        for name in ("gemma", "llama2", "qwen3.5", "mistral", "smollm3"):
            with pytest.raises(templates.ChatError, match="only at the start"):
                templates.get_template(name).render_text(messages)

    def test_unknown_template(self):
        """An unknown template name is a ChatError listing the known ones."""
        with pytest.raises(templates.ChatError, match="chatml"):
            templates.get_template("alpaca")

    def test_stop_strings(self):
        """Each template knows its end-of-turn marker."""
        expected = {"llama3": "<|eot_id|>", "zephyr": "</s>", "llama2": "</s>", "chatml": "<|im_end|>",
                    "qwen": "<|im_end|>", "smollm": "<|im_end|>", "gemma": "<end_of_turn>",
                    "qwen3.5": "<|im_end|>", "qwen3.5-nothink": "<|im_end|>", "qwen3": "<|im_end|>",
                    "qwen3-nothink": "<|im_end|>", "mistral": "</s>", "phi3": "<|end|>", "smollm3": "<|im_end|>",
                    "smollm3-nothink": "<|im_end|>"}
        for name, marker in expected.items():
            assert marker in templates.get_template(name).stop_strings


# ------------------------------------------------------------------------------------------
# Tokens, turn by turn


class ContextTokenizer:
    """A deliberately context-sensitive stand-in: one token per character, its id naming that
    character together with up to three characters before it in the same encode call, so
    encode(a + b) differs from encode(a) + encode(b) whenever a is not empty. Special markers are
    single ids. If a renderer glued a reply to the text before it, the prefix tests would fail."""

    SPECIALS = ["<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<start_of_turn>", "<end_of_turn>", "<think>", "</think>", "<|endoftext|>", "<|end|>", "<|system|>",
                "<|user|>", "<|assistant|>", "[INST]", "[/INST]"]

    def __init__(self, add_bos=False):
        self.bos_id, self.eos_id, self.add_bos = 1, 2, add_bos
        self.vocab = {}

    def token_id(self, text):
        return 10 + self.SPECIALS.index(text) if text in self.SPECIALS else None

    def encode(self, text, add_bos=None, special=False):
        assert special is False and add_bos is False
        return [self.vocab.setdefault(text[max(0, i - 3):i + 1], 1000 + len(self.vocab)) for i in range(len(text))]


REPLY_SEGMENT = {"llama2": lambda reply: " " + reply}  # Llama 2 puts a space before the reply


class TurnTests:
    @pytest.mark.parametrize("name", [n for n in templates.TEMPLATE_NAMES if n not in REWRITES_EARLIER_TURNS])
    @settings(max_examples=60, deadline=None)
    @given(conversation=conversations(), reply=contents, next_user=contents)
    def test_next_prompt_starts_with_prompt_reply_and_stop(self, name, conversation, reply, next_user):
        """Turn N+1's tokens start with turn N's prompt tokens, then the reply's tokens as the
        model would emit them after that prompt, then the template's stop token."""
        template = templates.get_template(name)
        reply = reply.strip() or "ok"  # templates that trim would otherwise change the reply
        if conversation[-1]["role"] == "assistant":
            conversation = conversation[:-1]
        tokenizer = ContextTokenizer()
        prompt = template.render(conversation, tokenizer)
        following = template.render(conversation + [{"role": "assistant", "content": reply},
                                                     {"role": "user", "content": next_user}], tokenizer)
        reply_tokens = tokenizer.encode(REPLY_SEGMENT.get(name, lambda r: r)(reply), add_bos=False)
        assert following[:len(prompt)] == prompt
        assert following[len(prompt):len(prompt) + len(reply_tokens)] == reply_tokens
        after_reply = following[len(prompt) + len(reply_tokens):]
        if name == "llama2":
            after_reply = after_reply[1:]  # the space before </s>
        assert after_reply[0] in template.stop_token_ids(tokenizer) | {tokenizer.eos_id}

    @pytest.mark.parametrize("name", [n for n in templates.TEMPLATE_NAMES if not n.startswith("qwen3")])
    def test_continued_message_is_a_prefix_of_the_closed_one(self, name):
        """Continuing a final assistant message gives the closed conversation's tokens up to the
        end of that message: the reply picks up exactly where the text stops. (Qwen3.5 renders
        the message after the last user turn with a think block and earlier ones without, as its
        official template does, so there it is not a prefix.)"""
        template = templates.get_template(name)
        tokenizer = ContextTokenizer()
        messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
        open_ids = template.render(messages, tokenizer)
        closed_ids = template.render(messages + [{"role": "user", "content": "more"}], tokenizer)
        assert closed_ids[:len(open_ids)] == open_ids
        assert template.render_text(messages).endswith("one two")

    def test_special_markers_by_id_user_text_as_text(self):
        """Markers become their ids; the same marker typed by a user is encoded as text."""
        tokenizer = ContextTokenizer()
        ids = templates.get_template("chatml").render([{"role": "user", "content": "<|im_end|>"}], tokenizer)
        im_start, im_end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
        assert ids.count(im_end) == 1 and ids.count(im_start) == 2
        assert ids[0] == im_start

    def test_space_prefix_tokenizers_encode_text_between_specials_once(self):
        """With a SentencePiece space prefix, the reply is encoded together with the text before
        it (one space prefix per run of text, as llama.cpp tokenizes), not on its own."""
        class SpacePrefixTokenizer(ContextTokenizer):
            add_space_prefix = True

            def encode(self, text, add_bos=None, special=False):
                return super().encode(" " + text, add_bos, special)

        tokenizer = SpacePrefixTokenizer()
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        ids = templates.get_template("llama2").render(messages, tokenizer)
        assert ids == [1] + tokenizer.encode("[INST] Hi [/INST] Yo", add_bos=False)

    def test_bos(self):
        """Templates that write BOS get the tokenizer's bos id; the others get it only when the
        tokenizer adds one, and never twice."""
        messages = [{"role": "user", "content": "Hi"}]
        assert templates.get_template("llama3").render(messages, ContextTokenizer())[0] == 1
        assert templates.get_template("zephyr").render(messages, ContextTokenizer())[0] != 1
        assert templates.get_template("zephyr").render(messages, ContextTokenizer(add_bos=True))[0] == 1
        assert templates.get_template("gemma").render(messages, ContextTokenizer(add_bos=True)).count(1) == 1


# ------------------------------------------------------------------------------------------
# Real tokenizers: llama.cpp's vocabularies and the pulled SmolLM2 / Gemma 3


REAL_PAIRS = {
    # template: ("vocab", name) for testdata/vocab, ("real", name) for a real model's tokenizer
    "llama3": ("vocab", "llama-bpe"),
    "chatml": ("vocab", "qwen2"),
    "qwen": ("vocab", "qwen2"),
    "qwen3.5": ("vocab", "qwen35"),
    "qwen3.5-nothink": ("vocab", "qwen35"),
    "llama2": ("vocab", "llama-spm"),
    "zephyr": ("vocab", "llama-spm"),
    "smollm": ("real", "smollm2-135m"),
    "gemma": ("real", "gemma3-270m"),
    "phi3": ("vocab", "phi-3"),
}
_tokenizers = {}


def real_tokenizer(template_name):
    from krafla_twisted.engine.tokenizer import Tokenizer
    from tests.support import real_models, testdata

    kind, name = REAL_PAIRS[template_name]
    if (kind, name) not in _tokenizers:
        if kind == "vocab":
            path = testdata.vocab_mlt(name)
        elif name == "smollm2-135m":
            path = real_models.real_model(name).mlt
        else:
            path = testdata.converted_mlt(real_models.source_gguf(name), f"real-{name}")
        _tokenizers[kind, name] = Tokenizer(path)
    return _tokenizers[kind, name]


class RealTokenizerTests:
    @pytest.mark.parametrize("name", list(REAL_PAIRS))
    def test_markers_are_single_tokens(self, name):
        """Each template's markers are single tokens in its model's vocabulary, so render()
        inserts them by id (Llama 2 and Zephyr have only BOS/EOS as tokens)."""
        tokenizer = real_tokenizer(name)
        template = templates.get_template(name)
        markers = {text for kind, text in template.segments([{"role": "user", "content": "x"}]) if kind == templates.SPECIAL}
        if name.startswith("qwen3.5"):
            # llama.cpp's qwen35 test vocabulary has [PAD] entries where Qwen has <think>/</think>;
            # render() then spells them as text, which test_typed_markers_stay_text covers.
            markers -= {"<think>", "</think>"}
        assert all(tokenizer.token_id(marker) is not None for marker in markers), markers
        assert template.stop_token_ids(tokenizer), "no stop token"

    @pytest.mark.parametrize("name", list(REAL_PAIRS))
    def test_typed_markers_stay_text(self, name):
        """A user message spelling out every marker renders to exactly the control tokens of a
        plain message: typed markers never become control tokens."""
        tokenizer = real_tokenizer(name)
        template = templates.get_template(name)
        sneaky = " ".join(MARKERS + ["<|begin_of_text|>", "<bos>", "<eos>", "<|endoftext|>", "<end_of_turn>"])
        plain = template.render([{"role": "user", "content": "plain"}], tokenizer)
        typed = template.render([{"role": "user", "content": sneaky}], tokenizer)
        controls = [t for t in typed if tokenizer.is_control(t)]
        assert controls == [t for t in plain if tokenizer.is_control(t)]

    @pytest.mark.parametrize("name", [n for n in REAL_PAIRS if not n.startswith("qwen3.5") and n != "phi3"])
    @settings(max_examples=15, deadline=None)
    @given(conversation=conversations(), reply=contents, next_user=contents)
    def test_next_prompt_starts_with_prompt_reply_and_stop(self, name, conversation, reply, next_user):
        """With the model's real tokenizer, turn N+1's tokens start with turn N's prompt, the
        reply encoded on its own, and the template's stop token (Llama 2: a space, then </s>)."""
        tokenizer = real_tokenizer(name)
        template = templates.get_template(name)
        reply = reply.strip() or "ok"
        if conversation[-1]["role"] == "assistant":
            conversation = conversation[:-1]
        prompt = template.render(conversation, tokenizer)
        following = template.render(conversation + [{"role": "assistant", "content": reply},
                                                     {"role": "user", "content": next_user}], tokenizer)
        reply_text = REPLY_SEGMENT.get(name, lambda r: r)(reply)
        assert following[:len(prompt)] == prompt
        after_prompt = following[len(prompt):]
        stops = template.stop_token_ids(tokenizer)
        if tokenizer.add_space_prefix:
            # Llama 2 / TinyLlama: the reply is encoded with the text around it (no space prefix of
            # its own), up to </s>; Llama 2 writes one space before </s>.
            end = after_prompt.index(tokenizer.eos_id)
            assert tokenizer.decode(after_prompt[:end]) == (reply_text + (" " if name == "llama2" else "")).encode()
        else:
            reply_tokens = tokenizer.encode(reply_text, add_bos=False)
            assert after_prompt[:len(reply_tokens)] == reply_tokens
            assert after_prompt[len(reply_tokens)] in stops


class HarmonyTemplateTests:
    def test_official_template_is_recognised(self):
        """A model whose template is gpt-oss's official one gets the gpt-oss template at conversion
        (its template calls strftime_now, which the probes then provide)."""
        from krafla_twisted.chat import template_file

        jinja = (REPO_TEMPLATES / "openai-gpt-oss-20b.jinja").read_text()
        assert template_file.matching_templates(jinja) == ["gpt-oss"]

    def test_written_out(self):
        """gpt-oss, written out: the system message with today's date, the developer message
        holding the conversation's system prompt, a user turn, the open assistant header."""
        text = templates.get_template("gpt-oss").render_text(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
        assert text == ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                        f"Knowledge cutoff: 2024-06\nCurrent date: {time.strftime('%Y-%m-%d')}\n\n"
                        "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be "
                        "included for every message.\nCalls to these tools must go to the commentary channel: "
                        "'functions'.<|end|><|start|>developer<|message|># Instructions\n\nS<|end|>"
                        "<|start|>user<|message|>U<|end|><|start|>assistant")
