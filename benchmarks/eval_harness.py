"""lm-evaluation-harness against radixserve and against transformers: the same scores.

Evaluation harnesses talk to a server through ``/v1/completions``: a multiple-choice task
scores each choice with ``echo``, ``logprobs: 1`` and ``max_tokens: 1`` (the prompt's
logprobs, and whether each token was the likeliest), a generation task decodes greedily up
to a stop string; lm-evaluation-harness's ``local-completions`` model also finds the
server's tokenizer through ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``.

This runs lm-eval's ``run`` three times on the same tasks, held out from everything
radixserve was tuned on and made here from a seed (arithmetic, what comes next in a
sequence of days, months, numbers or letters; local JSON, no hub):

    hf      lm-eval's own ``hf`` model: transformers on the CPU, float32
    openai  ``local-completions`` against ``radixserve serve --dtype float32``'s
            ``/v1/completions``
    sglang  ``sglang-generate`` against the same server's SGLang ``/generate``
            (``input_token_logprobs`` and ``input_top_logprobs`` of token-id prompts)

and compares each served run with transformers' request by request: each choice's log-likelihood (largest and median
absolute difference), whether its tokens were all the likeliest (lm-eval's ``is_greedy``),
each generated answer (the same text?), and each task's metrics.

lm-eval is not a dependency of radixserve: run this with a Python that has both, e.g. a
virtual environment over this one's packages:

    python -m venv --system-site-packages /tmp/lmeval && /tmp/lmeval/bin/pip install lm-eval
    /tmp/lmeval/bin/python benchmarks/eval_harness.py --items 100 --out benchmarks/results/eval_harness_s45.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent))
from bench_speculative import Server  # noqa: E402

SEQUENCES = {
    "days": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "months": (
        "January February March April May June July August September October November December"
    ).split(),
    "numbers": "one two three four five six seven eight nine ten eleven twelve".split(),
    "letters": list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
}

MC_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
filter_list:
  - name: answer
    filter:
      - function: regex
        regex_pattern: "{pattern}"
        group_select: {group}
      - function: take_first
metric_list:
  - metric: exact_match
"""


def arithmetic(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """ "What is a plus b?": the sum among three near misses."""
    items = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        s = a + b
        options = [s, s + 1, s - 1, s + 10]
        rng.shuffle(options)
        items.append(
            {
                "question": f"Question: What is {a} plus {b}?\nAnswer:",
                "choices": [f" {o}" for o in options],
                "answer": options.index(s),
                "target": str(s),
            }
        )
    return items


def next_in_sequence(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Three or four items of a well-known sequence; which comes next, among four."""
    items = []
    for _ in range(n):
        seq = SEQUENCES[rng.choice(sorted(SEQUENCES))]
        k = rng.randint(3, 4)
        start = rng.randint(0, len(seq) - k - 1)
        shown, nxt = seq[start : start + k], seq[start + k]
        wrong = rng.sample([w for w in seq if w != nxt], 3)
        options = [nxt, *wrong]
        rng.shuffle(options)
        items.append(
            {
                "question": f"{', '.join(shown)},",
                "choices": [f" {o}" for o in options],
                "answer": options.index(nxt),
                "target": nxt,
            }
        )
    return items


def write_tasks(root: Path, items: int, seed: int) -> list[str]:
    """The tasks' YAML and JSON under ``root``; their names."""
    rng = random.Random(seed)
    data = {"rs_arith": arithmetic(rng, items), "rs_next": next_in_sequence(rng, items)}
    # The answer in what the model writes: the sum's last number ("19 + 28 = 47"), the
    # sequence's first word ("Friday, Saturday, ...").
    answers = {"rs_arith": (r"-?[0-9]+", -1), "rs_next": (r"[A-Za-z]+", 0)}
    names = []
    for name, rows in data.items():
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}_mc.yaml").write_text(MC_TASK.format(name=f"{name}_mc", data=path))
        pattern, group = answers[name]
        gen = GEN_TASK.format(name=f"{name}_gen", data=path, pattern=pattern, group=group)
        (root / f"{name}_gen.yaml").write_text(gen)
        names += [f"{name}_mc", f"{name}_gen"]
    return names


def run_lm_eval(
    exe: str, model: str, model_args: str, tasks: list[str], root: Path, out: Path
) -> dict[str, Any]:
    """One ``lm-eval run`` on the CPU; its results and its logged samples by task."""
    cmd = [exe, "run", "--model", model, "--model_args", model_args, "--tasks", ",".join(tasks)]
    cmd += ["--include_path", str(root), "--output_path", str(out), "--log_samples"]
    cmd += ["--batch_size", "8", "--device", "cpu"]
    subprocess.run(cmd, check=True)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return {"results": results["results"], "samples": samples}


def compare(hf: dict[str, Any], served: dict[str, Any], tasks: list[str]) -> dict[str, Any]:
    """Per task: the metrics of both, and request by request how far apart they are."""
    out: dict[str, Any] = {}
    for task in tasks:
        pairs = list(zip(_by_doc(hf["samples"][task]), _by_doc(served["samples"][task])))
        row: dict[str, Any] = {
            "docs": len(pairs),
            "metrics": {
                name: {"hf": hf["results"][task].get(k), "served": served["results"][task].get(k)}
                for name, k in _metric_keys(hf["results"][task])
            },
        }
        if task.endswith("_mc"):
            diffs, greedy_same, picks_same = [], 0, 0
            for a, b in pairs:
                la, lb = _lls(a), _lls(b)
                diffs += [abs(x[0] - y[0]) for x, y in zip(la, lb)]
                greedy_same += sum(x[1] == y[1] for x, y in zip(la, lb))
                picks_same += _argmax(la) == _argmax(lb)
            row.update(
                requests=len(diffs),
                loglik_abs_diff_max=max(diffs),
                loglik_abs_diff_median=statistics.median(diffs),
                is_greedy_same=greedy_same,
                choice_same=picks_same,
            )
        else:
            same = sum(_answer(a) == _answer(b) for a, b in pairs)
            examples = [(a["target"], _answer(a), _answer(b)) for a, b in pairs[:3]]
            row.update(answers_same=same, examples_target_hf_served=examples)
        out[task] = row
    return out


def _by_doc(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(samples, key=lambda s: s["doc_id"])


def _lls(sample: dict[str, Any]) -> list[tuple[float, bool]]:
    """Each choice's (log-likelihood, is_greedy), as lm-eval logged it."""
    return [(float(r[0][0]), bool(r[0][1])) for r in sample["resps"]]


def _argmax(lls: list[tuple[float, bool]]) -> int:
    return max(range(len(lls)), key=lambda i: lls[i][0])


def _answer(sample: dict[str, Any]) -> str:
    return str(sample["filtered_resps"][0])


def _metric_keys(results: dict[str, Any]) -> list[tuple[str, str]]:
    """lm-eval's metric keys (``acc,none``), stderr left out; with the name to show as."""
    return [(k.split(",")[0], k) for k in results if "," in k and "_stderr" not in k]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval.utils import check_remote_tokenizer_support

    from radixserve.model_store import resolve_model

    model_dir = resolve_model(args.model or None)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks = write_tasks(root, args.items, args.seed)
        hf = run_lm_eval(
            args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", tasks, root, root / "hf"
        )
        server = Server(args.model, ["--dtype", "float32", "--num-threads", str(args.threads)])
        try:
            # What tokenizer_backend=auto asks before it picks the server's tokenizer.
            detected = check_remote_tokenizer_support(server.url + "/v1/completions")
            common = f"model=default,num_concurrent={args.concurrent},max_retries=1"
            openai = run_lm_eval(
                args.lm_eval,
                "local-completions",
                f"{common},base_url={server.url}/v1/completions,tokenizer_backend=auto",
                tasks,
                root,
                root / "openai",
            )
            sglang = run_lm_eval(
                args.lm_eval,
                "sglang-generate",
                f"{common},base_url={server.url}/generate,tokenizer={model_dir}",
                tasks,
                root,
                root / "sglang",
            )
        finally:
            server.stop()
    return {
        "model": str(model_dir),
        "items_per_task": args.items,
        "seed": args.seed,
        "remote_tokenizer_detected": detected,
        "tasks": compare(hf, openai, tasks),
        # lm-eval's sglang-generate reads is_greedy from SGLang's answer its own way: the
        # log-likelihoods, choices and answers are what to compare there.
        "tasks_sglang_generate": compare(hf, sglang, tasks),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="'' for the default model, or a local HF dir")
    ap.add_argument("--items", type=int, default=100, help="documents per task")
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrent", type=int, default=4, help="lm-eval's num_concurrent")
    ap.add_argument(
        "--lm-eval",
        default=str(Path(sys.executable).with_name("lm-eval")),
        help="the lm-eval executable (default: the one beside this Python)",
    )
    ap.add_argument("--out", default="", help="write the result JSON here")
    args = ap.parse_args(argv)
    if not Path(args.lm_eval).exists() and shutil.which(args.lm_eval) is None:
        ap.error(f"no lm-eval at {args.lm_eval}: pip install lm-eval, or pass --lm-eval")
    return args


def main() -> None:
    args = parse()
    from provenance import header

    out = {**header("eval_harness"), **run(args)}
    print(json.dumps(out["tasks"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
