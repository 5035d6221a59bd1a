"""An agent loop through the OpenAI chat API: per-turn ``cached_tokens`` against the ideal.

Several agents share one system prompt with the tool descriptions and each runs
``--turns`` tool turns (a forced call, ``tool_choice: "required"``, then the tool result
appended) and a final answer. The ideal for turn t > 1 of an agent is all of turn t-1's
prompt and answer (the history is resent unchanged); for an agent's first turn it is the
shared system prompt, measured as what the previous agent's first turn had in common with
it (its ``cached_tokens`` on a warm server). Prints one line per turn and writes JSON.

    radixserve serve --model <a model whose template renders tools> --http-port 8000
    python benchmarks/bench_agent_loop.py --url http://127.0.0.1:8000 --agents 4 --turns 5

TTFT per turn is measured (streamed, first content or tool-call delta) and written; on a
shared machine it is not a number to quote. The JSON holds the date, the arguments, the
server's ``/get_model_info`` and one record per turn.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
import urllib.request
from typing import Any

SYSTEM = (
    "You are an operations agent. Use the tools to look things up before answering; "
    "call one tool at a time and read its result."
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 24}},
                "required": ["query"],
            },
        },
    }
    for name, desc in [
        ("search_docs", "Search the internal documentation and return the best passage."),
        ("read_ticket", "Read a support ticket by its id or title."),
        ("query_metrics", "Query a metric over the last hour and return its summary."),
        ("list_deploys", "List the deploys of a service today."),
    ]
]


def stream_turn(client: Any, messages: list[Any], choice: Any, max_tokens: int) -> dict[str, Any]:
    """One streamed turn: its tool call (if any), usage and time to the first delta."""
    start = time.perf_counter()
    ttft = None
    call: dict[str, Any] = {}
    content = ""
    usage = None
    for chunk in client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,  # one call a turn: the history keeps what the model wrote
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            d = ch.delta
            if ttft is None and (d.content or d.tool_calls):
                ttft = time.perf_counter() - start
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.id:
                    call = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                call["arguments"] += tc.function.arguments or ""
    assert usage is not None, "the server sent no usage"
    details = usage.prompt_tokens_details
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": (details.cached_tokens if details else 0) or 0,
        "ttft_s": ttft,
        "call": call or None,
        "content": content,
    }


def run(
    url: str, agents: int, turns: int, max_tokens: int = 200, api_key: str = "none"
) -> list[dict[str, Any]]:
    """Run the loop; one record per (agent, turn) with cached and ideal token counts."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0)
    records: list[dict[str, Any]] = []
    shared = 0  # the system prompt's tokens cached for the agents after the first
    for agent in range(agents):
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Agent {agent}: why did service {agent} page at 3am?"},
        ]
        previous = 0
        for turn in range(turns + 1):
            choice = "required" if turn < turns else "none"
            r = stream_turn(client, messages, choice, max_tokens)
            ideal = previous if turn else shared
            if agent == 0 and turn == 0:
                ideal = 0
            records.append({"agent": agent, "turn": turn + 1, "ideal_cached": ideal, **r})
            if agent == 0 and turn == 0:
                shared = r["prompt_tokens"]  # an upper bound: refined by agent 1's hit
            if agent == 1 and turn == 0:
                shared = r["cached_tokens"]
            previous = r["prompt_tokens"] + r["completion_tokens"]
            if r["call"] is None:
                break
            c = r["call"]
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                    ],
                }
            )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": c["id"],
                    "content": f"result {turn} for {c['name']}",
                }
            )
    return records


def model_info(url: str) -> dict[str, Any]:
    """The server's ``/get_model_info`` (which model, page size): recorded beside the turns."""
    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as r:
        info: dict[str, Any] = json.load(r)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--out", default="agent_loop.json")
    args = ap.parse_args()
    records = run(args.url, args.agents, args.turns, args.max_tokens)
    for r in records:
        ratio = r["cached_tokens"] / r["ideal_cached"] if r["ideal_cached"] else float("nan")
        print(
            f"agent {r['agent']} turn {r['turn']}: prompt {r['prompt_tokens']} "
            f"cached {r['cached_tokens']} ideal {r['ideal_cached']} ({ratio:.2f}) "
            f"answer {r['completion_tokens']}"
        )
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "args": vars(args),
        "model": model_info(args.url),
        "records": records,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
