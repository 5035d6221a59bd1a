"""Text prompts to token ids: one BOS, whether or not a chat template already wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.serving.prompts import encode_text

BOS = 1


class BosTokenizer:
    """Adds BOS in front like Llama's and Mistral's tokenizers; "<s>" in a text is BOS too."""

    bos_token = "<s>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        while text:
            if text.startswith(self.bos_token):
                ids.append(BOS)
                text = text[len(self.bos_token) :]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return ([BOS] if add_special_tokens else []) + ids


def test_a_text_gets_one_bos() -> None:
    tok = BosTokenizer()
    assert encode_text(tok, "hi") == [BOS, ord("h"), ord("i")]
    # A prompt rendered by a template that writes BOS itself: not a second one.
    assert encode_text(tok, "<s>hi") == [BOS, ord("h"), ord("i")]


def test_a_tokenizer_without_bos_is_left_alone() -> None:
    class Plain:
        bos_token = None

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text]

    assert encode_text(Plain(), "<s>x") == [ord(c) for c in "<s>x"]


def test_warm_up_encodes_renders_and_decodes_once() -> None:
    """The router's codec warms its tokenizer before serving: the chat template (when there
    is one), an encode and an incremental decode; a tokenizer that fails still serves."""
    from radixserve.serving.prompts import PromptCodec

    calls: list[str] = []

    class Recording(BosTokenizer):
        chat_template = "{{ messages }}"

        def apply_chat_template(self, conversation, tokenize, add_generation_prompt):  # type: ignore[no-untyped-def]
            calls.append("template")
            return "".join(m["content"] for m in conversation)

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append("encode")
            return super().encode(text, add_special_tokens)

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):  # type: ignore[no-untyped-def]
            calls.append("decode")
            return "".join(chr(i) for i in ids if i != BOS)

    PromptCodec(Recording()).warm_up()
    assert {"template", "encode", "decode"} <= set(calls)

    class Broken(BosTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise RuntimeError("no vocabulary")

    PromptCodec(Broken()).warm_up()  # logged, not raised: requests report their own errors


@pytest.mark.parametrize(
    "name",
    ["add_generation_prompt", "continue_final_message", "tools", "chat_template", "return_dict"],
)
def test_template_kwargs_may_not_set_what_the_rendering_passes(name: str) -> None:
    """A request's template variables cannot reopen what the request's own fields decide
    (continue_final_message, say, is checked against add_generation_prompt there)."""
    from radixserve.serving.prompts import PromptError, template_inputs

    with pytest.raises(PromptError, match=name):
        template_inputs(None, json.dumps({name: True}))


def test_every_named_argument_of_apply_chat_template_is_reserved() -> None:
    """chat_template_kwargs go to transformers' apply_chat_template beside its own
    arguments: none of those may come from a request (``chat_template`` would bring a
    template the server did not agree to run; ``return_dict`` would break the rendering)."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from radixserve.serving.prompts import RESERVED_TEMPLATE_VARS

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {
        n
        for n, prm in params.items()
        if n not in ("self", "conversation") and prm.kind is not prm.VAR_KEYWORD
    }
    assert named <= RESERVED_TEMPLATE_VARS, sorted(named - RESERVED_TEMPLATE_VARS)


def test_chat_template_flag_reads_a_file_or_an_inline_template(tmp_path: Path) -> None:
    from radixserve.serving.prompts import MAX_TEMPLATE_FILE_BYTES, read_chat_template

    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_chat_template(inline) == inline
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    assert read_chat_template(str(f)) == inline
    with pytest.raises(ValueError, match="no file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    f.write_text("{% for m in messages %}{{ m }}")
    with pytest.raises(ValueError, match="line 1"):
        read_chat_template(str(f))
    f.write_bytes(b" " * (MAX_TEMPLATE_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="over"):
        read_chat_template(str(f))
