"""``thinking_token_budget`` through the whole server: the `openai` client's request, the
router, the worker's engine, and the ``deepseek-r1`` reasoning split of what comes back.

The tiny reasoner (``<think>`` and ``</think>`` single tokens) serves a DeepSeek-R1-shaped
template that opens the block in the prompt, so the answer starts inside the reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import tiny_models
from http_helpers import Server, serve, stop

pytestmark = pytest.mark.slow

# ChatML turns; the assistant's turn opens <think>, as DeepSeek-R1's template does.
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def reasoner_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_models.build_tiny_reasoner(tmp_path_factory.mktemp("reasoner"))
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = R1_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    srv = serve(model, "--reasoning-parser", "deepseek-r1")
    yield srv
    stop(srv)


def _chat(srv: Server, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Why is the sky blue?"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def test_the_budget_closes_the_reasoning_and_the_model_answers(reasoner_server: Server) -> None:
    free = _chat(reasoner_server)
    budgeted = _chat(reasoner_server, thinking_token_budget=4)
    # Without a budget the block never closes: 16 tokens of reasoning, no answer.
    assert free.choices[0].message.content in (None, "")
    thought = free.choices[0].message.reasoning_content
    assert thought
    # With one, the first 4 tokens of the same reasoning, "\n</think>", then the answer.
    msg = budgeted.choices[0].message
    assert msg.reasoning_content.strip() and thought.startswith(msg.reasoning_content.rstrip("\n"))
    assert len(msg.reasoning_content) < len(thought) and msg.content
    assert budgeted.usage.completion_tokens == free.usage.completion_tokens == 16


def test_the_responses_api_takes_the_budget_too(reasoner_server: Server) -> None:
    client = openai.OpenAI(base_url=reasoner_server.url + "/v1", api_key="none", max_retries=0)
    r = client.responses.create(
        model="default",
        input="Why is the sky blue?",
        max_output_tokens=16,
        temperature=0,
        extra_body={"thinking_token_budget": 4, "store": False},
    )
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    assert r.output_text


def test_a_prefilled_reply_is_split_where_the_prefill_left_the_reasoning(
    reasoner_server: Server,
) -> None:
    """``continue_final_message``: the continuation of a prefill that closed its think block
    (or wrote none) is content, though R1's split starts inside the reasoning; of one that
    left the block open, reasoning. The model may not write the tags itself here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(reasoner_server.model_dir))
    no_tags = {str(tok.convert_tokens_to_ids(t)): -100 for t in ("<think>", "</think>")}
    client = openai.OpenAI(base_url=reasoner_server.url + "/v1", api_key="none", max_retries=0)

    def go_on(prefill: str) -> Any:
        out = client.chat.completions.create(
            model="default",
            messages=[
                {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": prefill},
            ],
            max_tokens=12,
            temperature=0,
            logit_bias=no_tags,
            extra_body={
                "ignore_eos": True,
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        )
        return out.choices[0].message

    for prefill in ("<think>\nShort.\n</think>\n\nBecause", "Because"):
        msg = go_on(prefill)
        assert msg.content and not msg.reasoning_content, prefill
    msg = go_on("<think>\nThe user asks")
    assert msg.reasoning_content and not msg.content
