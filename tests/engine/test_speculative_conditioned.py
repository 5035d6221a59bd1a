"""Speculative decoding for requests whose next token depends on the tokens before it
(tiny random Llama, bfloat16, greedy): a grammar (regex, JSON schema), penalties and a
pending ``min_tokens``. Output tokens and logprobs identical to decoding without
speculation; a draft is cut at the first token the grammar forbids, and the matcher ends at
exactly the tokens that stood (invariants after every step, every page back). Sampled
requests under a grammar draft too, their outputs valid."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import logprobs_of, random_prompts, solo, tokens_of

from radixserve.engine.engine import Engine
from radixserve.engine.outputs import StepOutput
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.speculation import Speculation
from radixserve.speculative import Drafter
from radixserve.speculative.drafter import DraftSource

PROMPTS = [p + p[:12] for p in random_prompts([9, 31], seed=1)]
LETTERS = r"[a-z]+"  # never complete-only: max_tokens ends every request
# A long array of three enums: repetitive text the n-gram drafter finds earlier in the output.
ARRAY_SCHEMA = json.dumps(
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 40}
)


def _params(n: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2, **kw)  # type: ignore[arg-type]


def _engine(model: Path, **kw: object) -> Engine:
    return Engine(
        str(model), dtype="bfloat16", num_threads=1, num_pages=256, page_size=4, seed=0, **kw
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_hd64_dir: Path) -> Iterator[dict[str, Engine]]:
    made = {
        "base": _engine(tiny_llama_hd64_dir),
        "spec": _engine(
            tiny_llama_hd64_dir, speculative_algorithm="ngram", speculative_num_tokens=8
        ),
    }
    yield made
    for e in made.values():
        e.close()


def _same_output(engines: dict[str, Engine], prompt: list[int], params: SamplingParams) -> int:
    """The speculating engine's output equals the plain one's; returns the drafts accepted."""
    want = solo(engines["base"], prompt, params)
    got = solo(engines["spec"], prompt, params)
    assert tokens_of(got) == tokens_of(want)
    assert logprobs_of(got) == logprobs_of(want)
    assert got[-1].finish_reason == want[-1].finish_reason
    usage = got[-1].usage
    assert usage is not None and usage.spec_accepted_tokens <= usage.spec_drafted_tokens
    spec = engines["spec"]
    assert spec.allocator.num_free + spec.cache.num_evictable_pages == spec.allocator.num_pages
    return usage.spec_accepted_tokens


@pytest.mark.parametrize(
    "constraint", [{"regex": LETTERS}, {"json_schema": ARRAY_SCHEMA}], ids=["regex", "json"]
)
def test_grammar_output_identical_with_drafts(
    engines: dict[str, Engine], constraint: dict[str, str]
) -> None:
    accepted = sum(_same_output(engines, p, _params(**constraint)) for p in PROMPTS)
    assert accepted > 0, "no draft stood: no verify row was checked against the grammar"


class _Oracle(Drafter):
    """Proposes the plain engine's own next tokens (``want``), with, every other call, a
    wrong token (the first of ``wrong`` that is not the right one) at draft position 1, and,
    with ``forbidden``, that token at position 3."""

    name = "oracle"

    def __init__(
        self, want: list[int], prompt_len: int, wrong: list[int], forbidden: int | None = None
    ) -> None:
        self.want, self.prompt_len = want, prompt_len
        self.wrong, self.forbidden = wrong, forbidden
        self.proposals: list[tuple[int, list[int]]] = []  # (tokens out before, proposal)

    def propose(self, req: DraftSource, k: int) -> list[int]:
        done = len(req.token_ids) - self.prompt_len
        draft = self.want[done : done + k]
        if self.wrong and len(self.proposals) % 2 and len(draft) > 1:
            draft[1] = next(t for t in self.wrong if t != draft[1])
        if self.forbidden is not None and len(draft) > 3:
            draft[3] = self.forbidden
        self.proposals.append((done, draft))
        return list(draft)

    def accepted(self, keep: int = 16) -> tuple[int, int]:
        """Drafted and accepted counts, each proposal cut to its first ``keep`` tokens."""
        kept = [(done, p[:keep]) for done, p in self.proposals]
        accepted = sum(
            next((i for i, (d, w) in enumerate(zip(p, self.want[done:])) if d != w), len(p))
            for done, p in kept
        )
        return sum(len(p) for _, p in kept), accepted


def _with_oracle(
    engines: dict[str, Engine], prompt: list[int], params: SamplingParams, **kw: object
) -> tuple[_Oracle, StepOutput]:
    """``prompt`` through the speculating engine with an :class:`_Oracle` of the plain
    engine's output as drafter: tokens and logprobs identical; the oracle and the last
    output back."""
    want = solo(engines["base"], prompt, params)
    speculation = engines["spec"].scheduler.speculation
    assert isinstance(speculation, Speculation)
    ngram = speculation.drafter.base
    oracle = _Oracle(tokens_of(want), len(prompt), **kw)  # type: ignore[arg-type]
    speculation.drafter.base = oracle
    try:
        got = solo(engines["spec"], prompt, params)
    finally:
        speculation.drafter.base = ngram
    assert tokens_of(got) == tokens_of(want)
    assert logprobs_of(got) == logprobs_of(want)
    assert got[-1].finish_reason == want[-1].finish_reason
    return oracle, got[-1]


def test_draft_cut_at_first_forbidden_token(engines: dict[str, Engine]) -> None:
    """A proposal is cut before the token the grammar forbids: the drafted count is what
    stands before it; a wrong (allowed) draft is rejected and the matcher ends at the
    accepted tokens, so the output is the plain one token for token."""
    tok = engines["base"].tokenizer
    letters = tok.convert_tokens_to_ids(["a", "b"])
    (digit,) = tok.convert_tokens_to_ids(["7"])
    oracle, last = _with_oracle(
        engines, PROMPTS[0], _params(regex=LETTERS), wrong=letters, forbidden=digit
    )
    drafted, accepted = oracle.accepted(keep=3)
    usage = last.usage
    assert usage is not None
    assert sum(len(p) for _, p in oracle.proposals) > usage.spec_drafted_tokens  # cut
    assert (usage.spec_drafted_tokens, usage.spec_accepted_tokens) == (drafted, accepted)
    assert 0 < accepted < drafted  # some partial acceptances


@pytest.mark.parametrize(
    "options",
    [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}],
    ids=["repetition", "frequency-presence"],
)
def test_penalties_see_the_drafts_before(
    engines: dict[str, Engine], options: dict[str, object]
) -> None:
    """Verify row ``i`` is penalized as if drafts ``0 .. i-1`` were output: with the right
    drafts proposed (a wrong one every other step), the output is the plain engine's and
    every right draft stands (the tables then follow the accepted tokens only)."""
    params = _params(40, **options)
    oracle, last = _with_oracle(engines, PROMPTS[1], params, wrong=[3, 4])
    drafted, accepted = oracle.accepted()
    usage = last.usage
    assert usage is not None
    assert (usage.spec_drafted_tokens, usage.spec_accepted_tokens) == (drafted, accepted)
    assert accepted > 0


def test_min_tokens_block_lifts_inside_a_verify_run(engines: dict[str, Engine]) -> None:
    """A stop token blocked by ``min_tokens`` is allowed from the verify row whose output
    count (drafts before it included) reaches ``min_tokens``: a request that stops at the
    first position it may, inside a run of drafts, stops there with drafts too."""
    prompt = PROMPTS[1]
    free = tokens_of(solo(engines["base"], prompt, _params(40)))
    for stop in sorted(set(free[4:]), key=free[4:].count, reverse=True)[:3]:
        for m in range(6, 24):
            params = _params(40, stop_token_ids=[stop], min_tokens=m)
            if len(tokens_of(solo(engines["base"], prompt, params))) != m + 1:
                continue  # it does not stop at the first position it may
            oracle, last = _with_oracle(engines, prompt, params, wrong=[])
            if any(done < m <= done + len(p) for done, p in oracle.proposals):
                assert last.finish_reason == "stop"
                return
    raise AssertionError("no min_tokens boundary fell inside a verify run")


def test_sampled_requests_under_a_grammar_draft_and_stay_valid(
    engines: dict[str, Engine],
) -> None:
    """Sampled constrained requests draft too (rejection sampling over the masked rows):
    every output matches its schema, and drafts were verified and some stood."""
    spec = engines["spec"]
    assert spec.flush_cache()
    params = [
        SamplingParams(max_tokens=60, temperature=0.5, seed=s, json_schema=ARRAY_SCHEMA)
        for s in range(6)
    ]
    outs = spec.generate([PROMPTS[i % 2] for i in range(6)], params)
    spec.check_invariants()
    for o in outs:
        if o.finish_reason == "stop":
            assert set(json.loads(o.text)) <= {"red", "green", "blue"}, o.text
        else:
            assert o.text.startswith("[") and o.finish_reason == "length"
    assert sum(o.usage.spec_accepted_tokens for o in outs) > 0
