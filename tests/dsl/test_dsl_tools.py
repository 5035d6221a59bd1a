"""Tools in the DSL: the ReAct example (frontend_dsl/examples/react_agent.py) on the tiny
Llama with Qwen3's chat template, calls forced, in process and through a router.

The loop's turns: each step's thought, its call (parsed by radixserve's Hermes parser,
arguments valid against the strict schemas) and the tool's result; then the answer. The
prompt text is the template's own rendering of the conversation (checked against
``render_chat_template`` of ``s.messages()`` for the system turn with its tools), and
each call's prompt is served from the cache up to the previous call's prompt.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from frontend_dsl import Backend, ToolReply, assistant, gen, program, system, tool_result, user
from frontend_dsl.chat_template import render_chat_template
from frontend_dsl.engine_backend import EngineBackend
from frontend_dsl.remote_backend import RemoteBackend
from radixserve.serving.router.launcher import LocalServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The tools' system turn alone is ~800 tokens of the tiny byte-level tokenizer.
ENGINE = dict(page_size=4, num_pages=2048, max_num_tokens=1024, max_model_len=2048)
PAGE = 4
STEPS = 2


def load_example() -> ModuleType:
    path = ROOT / "frontend_dsl" / "examples" / "react_agent.py"
    spec = importlib.util.spec_from_file_location("react_agent", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def qwen3_model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with Qwen3's published chat template (renders tools, Hermes calls)."""
    dst = tmp_path_factory.mktemp("dsl-tools") / "model"
    shutil.copytree(tiny_llama_dir, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = ROOT / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
    cfg["chat_template"] = template.read_text()
    cfg_path.write_text(json.dumps(cfg))
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module", params=["engine", "router"])
def backend(request: pytest.FixtureRequest, qwen3_model: Path) -> Iterator[Backend]:
    if request.param == "engine":
        b: Backend = EngineBackend(model=str(qwen3_model), **ENGINE)
        yield b
        b.close()
        return
    srv = LocalServer(qwen3_model, num_workers=1, engine_config=dict(ENGINE, num_threads=1))
    srv.start(timeout_s=400)  # a loaded 2-core machine starts a worker slowly
    b = RemoteBackend(srv.endpoint, timeout=120)
    try:
        yield b
    finally:
        b.close()
        srv.close()
        assert all(proc.poll() is not None for proc in srv.procs), "a worker outlived the server"


def test_react_loop_with_forced_calls(backend: Backend) -> None:
    react = load_example()
    state = react.react.run(
        "How many people live in Paris, times two?",
        max_steps=STEPS,
        force_calls=True,
        backend=backend,
        defaults={"temperature": 0.0},
    )
    state.raise_for_error()
    trace = state.ret_value
    assert len(trace) == STEPS  # every step called a tool (forced), then the answer
    for _thought, name, args, result in trace:
        assert name in ("calculator", "lookup")
        if name == "lookup":
            assert args["city"] in ("Paris", "Tokyo", "Lima") and result != "unknown"
        else:
            assert set(args) == {"expression"} and len(args["expression"]) <= 24
    assert isinstance(state["answer"], str)
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user"] + ["assistant", "tool"] * STEPS + ["assistant"]
    # The system turn with its tools is the template's own rendering.
    info = backend.model_info()
    rendered = render_chat_template(
        info.chat_template or "",
        [{"role": "system", "content": react.SYSTEM}],
        special_tokens=info.special_tokens,
        tools=react.TOOLS,
    )
    assert state.text().startswith(rendered)
    assert "<tool_response>\n" + trace[0][3] + "\n</tool_response>" in state.text()


def test_each_turn_reuses_the_previous_turns_prefix(backend: Backend) -> None:
    """Turn N+1's first call finds turn N's whole prompt in the cache (whole pages)."""
    react = load_example()

    @program
    def loop(s: Any) -> list[dict[str, int]]:
        s += system(react.SYSTEM, tools=react.TOOLS)
        s += user("What is 2 + 3?")
        usage = []
        for _ in range(3):
            s += assistant(gen("step", tools=react.TOOLS, tool_choice="calculator", max_tokens=160))
            reply = s["step"]
            assert isinstance(reply, ToolReply) and reply.call is not None
            assert reply.call.name == "calculator" and not reply.content
            u = s.get_meta("step")["usage"]
            usage.append(
                {
                    "prompt": u.prompt_tokens,
                    "cached": u.cached_tokens,
                    "completion": u.completion_tokens,
                }
            )
            s += tool_result(reply.call, react.calculate(reply.arguments()["expression"]))
        return usage

    state = loop.run(backend=backend, defaults={"temperature": 0.0})
    state.raise_for_error()
    usage = state.ret_value
    for prev, cur in zip(usage, usage[1:]):
        assert cur["prompt"] > prev["prompt"] + prev["completion"]
        assert cur["cached"] >= prev["prompt"] // PAGE * PAGE - PAGE, usage
    print(f"\nDSL tool turns (prompt, cached, completion): {usage}")
