"""transformers' own continuous batching, in process: ``model.generate_batch``.

Runs inside the ``transformers`` peer venv (``setup_peers.sh transformers``), started by
``bench_peers.py`` as a subprocess (so its memory is measured on its own)::

    ~/.cache/radixserve/peers/transformers/bin/python benchmarks/peers/hf_cb_runner.py IN.json OUT.json

``IN.json``: ``{"model": DIR, "prompts": [[ids]...], "max_tokens": [n...], "max_batch": c,
"page_size": 16, "ignore_eos": true, "threads": 2, "warmup_prompt": [ids]}``.
``OUT.json``: wall time, per-request output ids, TTFT from the recorded token timestamps
(all requests are queued at t0, so TTFT includes queueing, like a client sending them all
at once with ``max_batch`` in flight), and the process's peak RSS.

Greedy (``do_sample=False``); prefix sharing (``allow_block_sharing``) on; page size as
given (transformers' default is 256 tokens, which shares only whole 256-token blocks).
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(int(cfg.get("threads", 2)))
    model = AutoModelForCausalLM.from_pretrained(
        cfg["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    max_new = int(max(cfg["max_tokens"]))
    gen_kw = dict(max_new_tokens=max_new, do_sample=False)
    if cfg.get("ignore_eos", True):
        gen_kw.update(eos_token_id=None, min_new_tokens=max_new)
    gen = GenerationConfig(**gen_kw)
    cb = ContinuousBatchingConfig(
        page_size=int(cfg.get("page_size", 16)),
        max_requests_per_batch=int(cfg["max_batch"]),
        allow_block_sharing=True,
        num_blocks=int(cfg.get("num_blocks", 2912)),
        max_batch_tokens=int(cfg.get("max_batch_tokens", 2048)),
    )
    if cfg.get("warmup_prompt"):
        model.generate_batch(
            [cfg["warmup_prompt"]],
            generation_config=GenerationConfig(max_new_tokens=4, do_sample=False),
            continuous_batching_config=cb,
            progress_bar=False,
        )
    t0 = time.perf_counter()
    outs = model.generate_batch(
        cfg["prompts"],
        generation_config=gen,
        continuous_batching_config=cb,
        record_timestamps=True,
        progress_bar=False,
    )
    wall = time.perf_counter() - t0
    # generate_batch keys its outputs by request id, in submission order ("req_0", ...).
    ordered = sorted(outs.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    results = []
    for o in ordered:
        ts = o.timestamps or []
        results.append(
            {
                "output_ids": list(map(int, o.generated_tokens)),
                "error": o.error,
                "ttft": (ts[0] - t0) if ts else None,
                "itl": [b - a for a, b in zip(ts, ts[1:])],
                "e2e": (ts[-1] - t0) if ts else None,
            }
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    json.dump(
        {
            "wall_s": wall,
            "results": results,
            "peak_rss": peak,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        open(sys.argv[2], "w"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
