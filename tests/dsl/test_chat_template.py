"""Role markers derived from chat templates reproduce ``tokenizer.apply_chat_template`` exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend_dsl import FakeBackend, RoleFormat, assistant, program, system, user
from frontend_dsl.chat_template import render_chat_template

LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
STRICT_ALTERNATION = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system only first') }}{% endif %}"
    "{{ '[' + message['role'] + ']' + message['content'] + '[/]' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "More?"},
    ],
    [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
]


def _concat(fmt: RoleFormat, messages: list[dict[str, str]]) -> str:
    out = ""
    for m in messages:
        out += fmt.open(m["role"], first=not out) + m["content"] + fmt.close(m["role"])
    return out


@pytest.mark.parametrize("template", [LLAMA3_STYLE, STRICT_ALTERNATION])
def test_markers_reproduce_rendering(template: str) -> None:
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    fmt = RoleFormat.from_template(template, special)
    assert fmt.templated
    for conv in CONVERSATIONS[:2]:
        assert _concat(fmt, conv) == render_chat_template(template, conv, special_tokens=special)
    assert fmt.generation_prompt == fmt.prefix["assistant"]


def test_no_template_gives_plain_markers() -> None:
    fmt = RoleFormat.from_template(None)
    assert fmt.open("user", first=True) == "User: " and not fmt.templated


def _hf_check(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    fmt = RoleFormat.from_template(tok.chat_template, special)
    for conv in CONVERSATIONS:
        assert _concat(fmt, conv) == tok.apply_chat_template(conv, tokenize=False)
        assert render_chat_template(
            tok.chat_template, conv, add_generation_prompt=True, special_tokens=special
        ) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_tiny_model_template_matches_transformers(tiny_llama_dir: Path) -> None:
    _hf_check(tiny_llama_dir)


@pytest.mark.slow
def test_smollm2_template_matches_transformers(smollm2_dir: Path) -> None:
    # SmolLM2's template adds a default system prompt when the first message is not a system one.
    _hf_check(smollm2_dir)


def test_program_text_equals_template_of_its_messages() -> None:
    backend = FakeBackend(chat_template=LLAMA3_STYLE)

    @program
    def chat(s):
        s += system("sys")
        s += user("question")
        s += assistant("answer")

    state = chat.run(backend=backend)
    special = backend.model_info().special_tokens
    assert state.text() == render_chat_template(
        LLAMA3_STYLE, state.messages(), special_tokens=special
    )
