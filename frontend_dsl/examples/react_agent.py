"""A small ReAct agent: think, call a tool, read its result, answer; its prefix reused each turn.

The program declares two tools in its system turn (the model's chat template renders
them), and each turn the model writes a thought, then a call (``gen(tools=...)``, parsed
by radixserve's tool-call parser); the program runs the tool and appends its result as
a tool turn. Each turn's prompt is the previous turn's prompt plus what was written since,
so the radix cache serves it again (``usage`` per call shows it).

Needs a model whose chat template renders tools (Qwen2.5 / Qwen3 / Hermes style):

    radixserve serve --model Qwen/Qwen2.5-0.5B-Instruct &
    python frontend_dsl/examples/react_agent.py
    python frontend_dsl/examples/react_agent.py --local --model /path/to/qwen2.5
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from frontend_dsl import assistant, gen, program, system, tool, tool_result, user

CALCULATOR = tool(
    "calculator",
    "Evaluate an arithmetic expression with + - * / and parentheses.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/() .-]{1,24}$"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    strict=True,
)
LOOKUP = tool(
    "lookup",
    "Look up a fact about a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
            "fact": {"type": "string", "enum": ["population", "country"]},
        },
        "required": ["city", "fact"],
        "additionalProperties": False,
    },
    strict=True,
)
TOOLS = [CALCULATOR, LOOKUP]
FACTS = {
    ("Paris", "population"): "2.1 million",
    ("Paris", "country"): "France",
    ("Tokyo", "population"): "14 million",
    ("Tokyo", "country"): "Japan",
    ("Lima", "population"): "10 million",
    ("Lima", "country"): "Peru",
}
SYSTEM = (
    "You are a careful agent. For each step, write one short thought, then call one tool. "
    "When you have what you need, answer in one sentence without calling a tool."
)
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """Arithmetic only (no names, no calls): the model's text is never executed."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"


def run_tool(name: str, args: dict[str, Any]) -> str:
    if name == "calculator":
        return calculate(str(args.get("expression", "")))
    return FACTS.get((args.get("city"), args.get("fact")), "unknown")  # type: ignore[arg-type]


@program
def react(s, question: str, max_steps: int = 3, force_calls: bool = False):
    """Up to ``max_steps`` tool steps, then the answer. ``force_calls``: every step must
    call a tool (``tool_choice="required"``); otherwise the model decides (``"auto"``).
    Returns the trace: one ``(thought, call name, arguments, result)`` per step."""
    s += system(SYSTEM, tools=TOOLS)
    s += user(question)
    trace: list[tuple[str, str, dict[str, Any], str]] = []
    for _ in range(max_steps):
        s += assistant(
            gen("thought", max_tokens=24, stop=["\n", "<tool_call>"])
            + "\n"
            + gen(
                "step",
                tools=TOOLS,
                tool_choice="required" if force_calls else "auto",
                parallel_tool_calls=False,
                max_tokens=128,
            )
        )
        reply = s["step"]
        if reply.call is None:  # no call: the model answered
            s.set_var("answer", reply.content)
            return trace
        args = reply.arguments()
        result = run_tool(reply.call.name, args)
        trace.append((s["thought"], reply.call.name, args, result))
        s += tool_result(reply.call, result)
    s += assistant(gen("answer", max_tokens=48, stop=["\n\n"]))
    return trace


def main() -> None:
    from _backend import make_backend, parse_args

    args = parse_args(__doc__.splitlines()[0])
    with make_backend(args) as backend:
        state = react.run(
            "How many people live in the capital of France, times two?",
            backend=backend,
            defaults={"temperature": 0.0},
        )
        state.raise_for_error()
        for thought, name, call_args, result in state.ret_value:
            print(f"thought: {thought.strip()}\n  {name}({call_args}) -> {result}")
        print(f"answer: {str(state.get('answer', '')).strip()}")
        usage = state.usage
        print(
            f"{usage.calls} calls: {usage.tokens_sent} prompt tokens sent, {usage.tokens_reused} "
            f"reused from the radix cache ({usage.hit_rate:.0%})"
        )


if __name__ == "__main__":
    main()
