"""The chat template from the model's own file (krafla_twisted/chat/template_file.py, issue 17): the
converter renders the model's Jinja template and krafla's built-in templates on the same
conversations and stores the name of the one that agrees in the .mlt.

The official templates are the independent side: each must be recognised as exactly the built-in
template tests/test_chat.py proves equal to it, and no other.
"""

import numpy as np
import pytest

from krafla_twisted.chat import template_file, templates
from krafla_twisted.cli import main
from krafla_twisted.convert import gguf as gguf_convert
from krafla_twisted.convert.tokenizer import CONTROL, NORMAL, TokenizerTables, build_container
from krafla_twisted.engine import formats
from tests.support import real_models
from tests.test_chat import official_template

OFFICIAL = {
    # file: (bos_token, eos_token, the built-in template it must be recognised as)
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>", "llama3"),
    # prints today's date when strftime_now is defined; without it, 26 Jul 2024 as llama3 does
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>", "llama3"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>", "qwen"),
    "HuggingFaceTB-SmolLM2-135M-Instruct.jinja": ("", "<|im_end|>", "smollm"),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>", "gemma"),
    "Qwen3.5-4B.jinja": ("", "<|im_end|>", "qwen3.5"),
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>", "qwen3"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>", "mistral"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>", "phi3"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("<|begin_of_text|>", "<|im_end|>", "smollm3"),
}
ALPACA = ("{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
          "{% else %}### Response:\n{{ m['content'] }}\n\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}### Response:\n{% endif %}")


def tokenizer_container(spellings, bos=0, eos=1):
    """A small .mlt container whose vocabulary is `spellings` (the first two control tokens)."""
    spellings = list(spellings) + ["x", "y", "xy"]
    types = [CONTROL if i < 2 or s.startswith("<") else NORMAL for i, s in enumerate(spellings)]
    tables = TokenizerTables("bpe", "gpt2", [s.encode() for s in spellings], types, merges=[(b"x", b"y")])
    tables.bos_id, tables.eos_id = bos, eos
    return build_container(tables)


class RecognitionTests:
    @pytest.mark.parametrize("name", sorted(OFFICIAL))
    def test_official_template_is_recognised_as_its_own(self, testdata, name):
        """Each official template agrees with exactly one built-in template: the one test_chat
        renders equal to it (chatml, which Qwen3's template equals without reasoning, is told
        apart by the probes with think blocks)."""
        bos, eos, expected = OFFICIAL[name]
        assert template_file.matching_templates(official_template(testdata, name).read_text(), bos, eos) == [expected]

    def test_unknown_template(self):
        """A template that is none of krafla's (Alpaca's) matches nothing, and the message says to
        give --chat."""
        assert template_file.matching_templates(ALPACA) == []
        container = tokenizer_container(["<s>", "</s>", "a"])
        name, how, message = template_file.choose(container, ALPACA)
        assert name is None and how == "jinja" and "--chat" in message
        template_file.store(container, ALPACA)
        assert "chat_template" not in container.metadata
        assert container.metadata["chat_template_jinja"] == ALPACA

    def test_template_that_does_not_compile(self):
        """A broken template is a TemplateFileError saying it does not compile."""
        with pytest.raises(template_file.TemplateFileError, match="does not compile"):
            template_file.matching_templates("{% for m in messages %}")

    def test_a_template_that_changes_one_word_is_not_recognised(self, testdata):
        """Changing Qwen2.5's default system prompt by one word makes it none of krafla's."""
        text = official_template(testdata, "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
        assert template_file.matching_templates(text.replace("helpful assistant", "useful assistant")) == []

    def test_vocabulary_markers_when_the_source_has_no_template(self):
        """Without a template, Gemma's turn markers name gemma; a vocabulary with the markers of
        no single format (chatml is shared by several) names none."""
        gemma = tokenizer_container(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "a"])
        assert template_file.choose(gemma, None)[:2] == ("gemma", "vocabulary")
        chatml = tokenizer_container(["<s>", "</s>", "<|im_start|>", "<|im_end|>", "a"])
        name, how, message = template_file.choose(chatml, None)
        assert name is None and "--chat" in message

    def test_template_of_reads_the_name_back(self, tmp_path):
        """template_of gives the stored name; a name this krafla does not know is a ChatError
        naming --chat."""
        container = tokenizer_container(["<s>", "</s>", "a"])
        container.metadata["chat_template"] = "phi3"
        formats.write(tmp_path / "t.mlt", container)
        assert template_file.template_of(tmp_path / "t.mlt") == "phi3"
        container.metadata["chat_template"] = "alpaca"
        formats.write(tmp_path / "u.mlt", container)
        with pytest.raises(templates.ChatError, match="--chat"):
            template_file.template_of(tmp_path / "u.mlt")


class RealGGUFTests:
    @pytest.mark.parametrize("name, expected, how", [("smollm2-135m", "smollm", "jinja"),
                                                     ("qwen2.5-coder-0.5b", "qwen", "jinja"),
                                                     ("gemma3-270m", "gemma", "vocabulary")])
    def test_real_gguf_picks_its_template(self, tmp_path, name, expected, how):
        """The three real GGUFs' tokenizers, converted, name the template of models.py's table:
        SmolLM2's and Qwen2.5-Coder's own templates render like smollm and qwen; gemma-3-270m's
        GGUF has none, and its <start_of_turn> markers name gemma."""
        mlt = gguf_convert.convert_gguf_tokenizer(real_models.source_gguf(name), tmp_path / "t.mlt", progress=False)
        metadata = formats.read(mlt).metadata
        assert (metadata["chat_template"], metadata["chat_template_from"]) == (expected, how)
        assert expected == real_models.models.KNOWN_MODELS[name].chat
        assert ("chat_template_jinja" in metadata) == (how == "jinja")

    def test_krafla_convert_says_which_template(self, tmp_path, capsys):
        """`krafla convert` of the real SmolLM2 GGUF prints the template it chose."""
        source = real_models.source_gguf("smollm2-135m")
        out = tmp_path / "smol.mlb"
        assert main.main(["convert", str(source), "-o", str(out), "--type", "q8_0", "-q"]) == 0
        printed = capsys.readouterr().out
        assert "chat template: smollm (renders like the model's own template)" in printed
        assert np.array_equal(formats.read(out.with_suffix(".mlt")).array("token_offsets"),
                              formats.read(real_models.real_model("smollm2-135m").mlt).array("token_offsets"))
