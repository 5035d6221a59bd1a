"""Predicted outputs through HTTP: a code edit answered with and without the code as its prediction.

A coding agent asks for a function with one name changed and sends the function as it is as
OpenAI's ``prediction``. This replays such edits, one request at a time through
``/v1/chat/completions`` (streamed, greedy), in four variants, interleaved request by request
with the order rotated (this machine's speed drifts: only same-run ratios mean anything):

    plain       a server without --speculative-algorithm, no prediction (the baseline)
    predicted   the same server, the function as the prediction
    ngram       a server with --speculative-algorithm ngram (prompt lookup: the prompt holds
                the function too), no prediction
    ngram+pred  that server, with the prediction

The functions are real code, held out from everything radixserve was tuned on: functions of
Python's own standard library (``inspect.getsource``), chosen by a seed among those of
``--min-lines`` to ``--max-lines`` lines with a parameter used in the body; the edit renames
that parameter. Greedy: every variant must give the same answer (``same_text`` per request;
the run fails otherwise).

Per request and variant: output tokens, time to first token, decode time after it, and
usage's accepted and rejected prediction tokens. Per variant: each request's time per output
token after the first over ``plain``'s for the same request, median and range.

    python benchmarks/bench_predicted_outputs.py --requests 12 --k 4
    python benchmarks/bench_predicted_outputs.py --variants plain,predicted --k 8 --out ''
    python benchmarks/bench_predicted_outputs.py --replay RESULT.json --out REPLAY.json

Writes JSON (``--out``) with every request's record.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent))
from bench_speculative import Server, sse_chunks  # noqa: E402

MODULES = (
    "textwrap shlex heapq bisect statistics calendar difflib fractions string html "
    "ipaddress base64 colorsys fnmatch glob posixpath ntpath quopri uu tokenize "
    "urllib.parse email.utils http.cookies csv pprint reprlib getopt optparse"
).split()
VARIANTS = ("plain", "predicted", "ngram", "ngram+pred")


def _renamable(fn: Any, src: str) -> str | None:
    """A parameter of ``fn`` used in its body at least twice (the edit renames it), or None."""
    try:
        params = [p for p in inspect.signature(fn).parameters if len(p) >= 3 and p != "self"]
    except (TypeError, ValueError):
        return None
    body = src.split(":", 1)[-1]
    for p in params:
        if len(re.findall(rf"\b{re.escape(p)}\b", body)) >= 2:
            return p
    return None


def functions(min_lines: int, max_lines: int) -> list[tuple[str, str, str]]:
    """(qualified name, source, parameter to rename) of every standard-library function of
    ``min_lines`` to ``max_lines`` lines that has a parameter to rename, in a stable order."""
    found = []
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, fn in sorted(vars(mod).items()):
            if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if not min_lines <= src.count("\n") <= max_lines or '"""' in src or "'''" in src:
                continue  # docstrings left out: the answers would quote prose, not code
            param = _renamable(fn, src)
            if param is not None:
                found.append((f"{mod_name}.{name}", src, param))
    return found


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--requests`` edits: functions drawn by ``--seed``, each with its rename."""
    pool = functions(args.min_lines, args.max_lines)
    rng = random.Random(args.seed)
    chosen = rng.sample(pool, min(args.requests, len(pool)))
    out = []
    for name, src, param in chosen:
        new = f"{param}_in"
        ask = (
            f"Rename the parameter `{param}` to `{new}` in this Python function. Reply with "
            f"the whole function and nothing else.\n\n```python\n{src}```"
        )
        out.append({"function": name, "param": param, "prompt": ask, "prediction": src})
    return out


def one_request(
    client: Any, req: dict[str, Any], predicted: bool, max_tokens: int
) -> dict[str, Any]:
    """One edit, streamed: the answer, its time to first token and decode time after it, and
    usage's token counts."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": req["prompt"]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if predicted:
        body["prediction"] = {"type": "content", "content": req["prediction"]}
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    text = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
    seconds = time.perf_counter() - t0
    details = usage.get("completion_tokens_details") or {}
    ttft = (first or t0 + seconds) - t0
    return {
        "text": "".join(text),
        "tokens": usage["completion_tokens"],
        "seconds": seconds,
        "ttft_s": ttft,
        "decode_s": seconds - ttft,
        "accepted": details.get("accepted_prediction_tokens", 0),
        "rejected": details.get("rejected_prediction_tokens", 0),
    }


def replay_edits(
    args: argparse.Namespace, clients: dict[str, Any], variants: list[str]
) -> list[dict[str, Any]]:
    """Every edit in every variant, the variants' order rotated per request."""
    records = []
    for rnd in range(args.rounds):
        for i, req in enumerate(workload(args)):
            turn = i + rnd
            order = variants[turn % len(variants) :] + variants[: turn % len(variants)]
            for v in order:
                server = "ngram" if v.startswith("ngram") else "plain"
                r = one_request(
                    clients[server], req, v in ("predicted", "ngram+pred"), args.max_tokens
                )
                records.append(
                    {"round": rnd, "request": i, "function": req["function"], "variant": v, **r}
                )
    return records


def per_token_ms(r: dict[str, Any]) -> float:
    """Decode time per output token after the first, ms."""
    return 1000 * r["decode_s"] / max(1, r["tokens"] - 1)


def summarize(records: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: totals, acceptance, and per request its time per token over plain's."""
    base = {(r["round"], r["request"]): r for r in records if r["variant"] == "plain"}
    out: dict[str, Any] = {}
    for v in variants:
        rows = [r for r in records if r["variant"] == v]
        ratios = [per_token_ms(r) / per_token_ms(base[(r["round"], r["request"])]) for r in rows]
        drafted = sum(r["accepted"] + r["rejected"] for r in rows)
        out[v] = {
            "requests": len(rows),
            "tokens": sum(r["tokens"] for r in rows),
            "per_token_ms_median": statistics.median(per_token_ms(r) for r in rows),
            "over_plain": sorted(ratios),
            "over_plain_median": statistics.median(ratios),
            "accepted": sum(r["accepted"] for r in rows),
            "drafted": drafted,
            "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else 0.0,
            "same_text": all(r["text"] == base[(r["round"], r["request"])]["text"] for r in rows),
        }
    return out


class _Draft:
    """What a drafter reads of a request (the scheduler's ``Request``, in the replay)."""

    def __init__(self, prompt: list[int], first: int, prediction: list[int] | None) -> None:
        self.request_id, self.namespace = "r", None
        self.token_ids, self.prompt_len, self.prediction = [*prompt, first], len(prompt), prediction


def replay_one(
    drafter: Any, prompt: list[int], answer: list[int], prediction: list[int] | None, k_max: int
) -> tuple[int, int, int]:
    """Decode ``answer`` again as the scheduler would with ``drafter``'s drafts (the adaptive
    k, greedy acceptance): (forwards after the prefill, drafted, accepted)."""
    from radixserve.speculative import AdaptiveK, accepted_length

    req, k_of = _Draft(prompt, answer[0], prediction), AdaptiveK(k_max)
    steps = drafted = accepted = 0
    out = 1  # the prefill's token
    while out < len(answer):
        steps += 1
        k = min(k_of.budget(steps), len(answer) - out - 1)
        draft = drafter.propose(req, k) if k > 0 else []
        stood = accepted_length(draft, answer[out:]) if draft else 0
        k_of.update(len(draft), stood, steps)
        drafted, accepted = drafted + len(draft), accepted + stood
        req.token_ids += answer[out : out + stood + 1]
        out += stood + 1
    drafter.finished(req)
    return steps, drafted, accepted


def replay_answers(args: argparse.Namespace) -> dict[str, Any]:
    """``--replay FILE``: the answers of FILE's ``plain`` variant decoded again, without a
    model, under prompt lookup alone and under the prediction's drafter at each
    ``--min-match``: output tokens per forward after the prefill. (Answers re-encoded from
    their text: a model's own tokens may differ in a few places.)"""
    from transformers import AutoTokenizer

    from radixserve.model_store import resolve_model
    from radixserve.speculative import prediction as pm
    from radixserve.speculative.ngram import NgramDrafter

    done = json.loads(Path(args.replay).read_text())
    tok = AutoTokenizer.from_pretrained(resolve_model(done["args"]["model"] or None))
    plain = {
        (r["round"], r["request"]): r["text"] for r in done["requests"] if r["variant"] == "plain"
    }
    edits = workload(argparse.Namespace(**done["args"]))
    cases = []
    for (_, i), text in sorted(plain.items()):
        msgs = [{"role": "user", "content": edits[i]["prompt"]}]
        prompt = list(
            tok.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        answer = tok.encode(text, add_special_tokens=False)
        cases.append((prompt, answer, tok.encode(edits[i]["prediction"], add_special_tokens=False)))
    drafters: dict[str, tuple[Any, bool]] = {"ngram": (NgramDrafter, False)}
    for m in (int(x) for x in args.min_match.split(",")):
        drafters[f"prediction, min_match {m}"] = (lambda m=m: _with_min_match(pm, m), True)
    results = {}
    for name, (make, predicted) in drafters.items():
        steps = drafted = accepted = tokens = 0
        for prompt, answer, pred in cases:
            s, d, a = replay_one(make(), prompt, answer, pred if predicted else None, args.k)
            steps, drafted, accepted, tokens = (
                steps + s,
                drafted + d,
                accepted + a,
                tokens + len(answer) - 1,
            )
        results[name] = {
            "tokens_per_forward": tokens / steps,
            "drafted": drafted,
            "accepted": accepted,
        }
        print(name, json.dumps(results[name]))
    return {"args": vars(args), "replayed": args.replay, "results": results}


def _with_min_match(pm: Any, m: int) -> Any:
    """A prediction drafter (no server algorithm) whose rejoin needs ``m`` agreeing tokens."""
    pm.MIN_MATCH, pm.MAX_MATCH = m, max(8, m)
    return pm.PredictionDrafter(None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    variants = [v for v in args.variants.split(",") if v]
    if variants[0] != "plain" or any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: plain first, then any of {', '.join(VARIANTS[1:])}")
    common = ["--num-threads", str(args.threads), "--dtype", args.dtype]
    common += ["--speculative-num-tokens", str(args.k)]
    wanted = {"ngram" if v.startswith("ngram") else "plain" for v in variants}
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="bench_predicted_"):
        try:
            for s in sorted(wanted, reverse=True):
                extra = ["--speculative-algorithm", "ngram"] if s == "ngram" else []
                servers[s] = Server(args.model, common + extra)
            clients = {s: httpx.Client(base_url=srv.url, timeout=600) for s, srv in servers.items()}
            records = replay_edits(args, clients, variants)
            for c in clients.values():
                c.close()
        finally:
            for srv in servers.values():
                srv.stop()
    results = summarize(records, variants)
    bad = [v for v, row in results.items() if not row["same_text"]]
    if bad:
        raise SystemExit(f"answers differ from plain's under greedy decoding: {bad}")
    return {"args": vars(args), "results": results, "requests": records}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="", help="a local HF dir (default: the default model)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="the same edits again, rotated")
    ap.add_argument("--min-lines", type=int, default=8)
    ap.add_argument("--max-lines", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--k", type=int, default=4, help="--speculative-num-tokens of both servers")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", default="", help="a result JSON: replay its answers (no server)")
    ap.add_argument("--min-match", default="3,4,5,6,8", help="--replay: the rejoin thresholds")
    ap.add_argument("--out", default="benchmarks/results/bench_predicted_outputs.json")
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    from provenance import header

    if args.replay:
        out = {**header("bench_predicted_outputs"), **replay_answers(args)}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        return
    out = {**header("bench_predicted_outputs"), **run(args)}
    for v, row in out["results"].items():
        brief = {k: val for k, val in row.items() if k != "over_plain"}
        print(v, json.dumps(brief))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
