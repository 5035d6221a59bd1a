"""A decode step's Python work does not grow with the context (issue 44).

The KV a decode step reads grows with the context; the host work of planning it must not:
the scheduler's plan, the runner's staging and the attention backend's plan take the same
Python lines at 8 tokens of context as at 600 (page lists are sliced, joined and converted
in C, never walked page by page in Python). Counted with ``sys.settrace`` line events over
the package's own code, so the test holds without timing anything.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

PACKAGE = str(Path(__file__).resolve().parents[2] / "radixserve")
PAGE = 4


def lines_of_one_step(engine: Engine) -> Counter[tuple[str, str]]:
    """Line events of one ``engine.step()`` in radixserve's code, per (file, function)."""
    lines: Counter[tuple[str, str]] = Counter()

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return None  # torch and the standard library: not ours, not traced line by line
        if event == "line":
            lines[(Path(code.co_filename).name, code.co_name)] += 1
        return trace

    sys.settrace(trace)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    return lines


def second_decode_step(engine: Engine, prompt_len: int) -> Counter[tuple[str, str]]:
    """The line events of the second decode step of a fresh prompt of ``prompt_len`` tokens."""
    prompt = [3 + (7 * i) % 400 for i in range(prompt_len)]
    engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while not any(o.new_token_ids for o in engine.step()):
        pass  # prefill, in chunks
    engine.step()  # the first decode step
    lines = lines_of_one_step(engine)
    while engine.has_unfinished():
        engine.step()
    return lines


def test_decode_step_python_work_is_independent_of_the_context(
    tiny_llama_dir: Path, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(
        tiny_llama_dir, page_size=PAGE, num_pages=400, max_num_tokens=256, max_running_requests=2
    )
    # Both prompts end at the same offset in their last page: the same steps open a new page.
    short = second_decode_step(engine, 2 * PAGE + 1)
    long = second_decode_step(engine, 150 * PAGE + 1)
    assert sum(short.values()) > 0
    grew = {k: (short[k], long[k]) for k in short | long if short[k] != long[k]}
    assert not grew, f"Python lines per decode step that grew with the context: {grew}"
