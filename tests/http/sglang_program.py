"""SGLang frontend programs against a radixserve HTTP server: ``python sglang_program.py URL``.

Runs in an interpreter that has the ``sglang`` package (its frontend language only; see
test_http_sglang_frontend.py) and prints one JSON object with what the programs produced.
"""

from __future__ import annotations

import json
import sys

import sglang as sgl


@sgl.function
def qa(s, question):  # type: ignore[no-untyped-def]
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


@sgl.function
def pick(s):  # type: ignore[no-untyped-def]
    s += "Question: which city is the capital of France, the country with the Eiffel tower? Answer:"
    s += sgl.select("city", choices=[" Paris", " London", " Berlin"])


@sgl.function
def number(s):  # type: ignore[no-untyped-def]
    s += "A number: " + sgl.gen("n", max_tokens=6, regex="[0-9]+", temperature=0)


@sgl.function
def forked(s):  # type: ignore[no-untyped-def]
    s += "Two continuations of a shared prefix that is long enough to be cached in pages:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" ({i})" + sgl.gen("x", max_tokens=4, temperature=0)
    s += "".join(f["x"] for f in forks)


def main() -> None:
    backend = sgl.RuntimeEndpoint(sys.argv[1], chat_template_name="chatml")
    sgl.set_default_backend(backend)
    out: dict[str, object] = {"model_path": backend.get_model_name()}
    state = qa.run(question="What is a radix tree?")
    out["answer"] = state["answer"]
    out["answer_meta"] = state.get_meta_info("answer")
    streamed = qa.run(question="What is a radix tree?", stream=True)
    out["streamed"] = "".join(streamed.text_iter("answer"))
    out["batch"] = [st["answer"] for st in qa.run_batch([{"question": "a?"}, {"question": "b?"}])]
    choice = pick.run()
    out["city"] = choice["city"]
    out["city_meta"] = {k: v for k, v in (choice.get_meta_info("city") or {}).items()
                        if k in ("normalized_prompt_logprobs",)}
    out["number"] = number.run()["n"]
    out["forked"] = forked.run().text()
    backend.flush_cache()
    out["server_info_keys"] = sorted(backend.get_server_info())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
