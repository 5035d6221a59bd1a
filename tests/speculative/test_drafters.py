"""The drafters, the suffix index and the adaptive draft length, on plain token lists."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.speculative import AdaptiveK, accepted_length, make_drafter
from radixserve.speculative.adaptive import FIRST_BACKOFF, MIN_VERIFIES
from radixserve.speculative.ngram import NgramDrafter
from radixserve.speculative.suffix_index import RadixDrafter, SuffixIndex


@dataclass
class Req:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    namespace: str | None = None
    extra: list[int] = field(default_factory=list)
    prediction: list[int] | None = None


def test_accepted_length_counts_the_agreeing_prefix() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5], [4, 5]) == 0
    assert accepted_length([], [4]) == 0


def test_ngram_copies_what_followed_the_longest_earlier_match() -> None:
    d = NgramDrafter()
    # "1 2" occurs twice; the context ends "... 9 1 2", which agrees longer with the
    # second occurrence ("9 1 2" -> 30 31), the more recent one too.
    tokens = [1, 2, 10, 11, 12, 8, 9, 1, 2, 30, 31, 32, 7, 9, 1, 2]
    req = Req("a", tokens, prompt_len=len(tokens))
    assert d.propose(req, 2) == [30, 31]
    assert d.propose(req, 8) == [30, 31, 32, 7, 9, 1, 2]  # up to the context's end
    # Grows with the request: the new tokens are indexed at the next proposal.
    tokens += [30, 31, 32, 7]
    assert d.propose(req, 3) == [9, 1, 2]
    assert d.propose(Req("b", [1, 2, 3], 3), 4) == []  # nothing earlier to copy
    d.finished(req)
    d.finished(Req("b", [], 0))
    assert d.tracked == 0


def test_ngram_rebuilds_when_tokens_are_cut_back() -> None:
    d = NgramDrafter()
    req = Req("a", [1, 2, 3, 1, 2, 3, 1, 2], 8)
    assert d.propose(req, 2) == [3, 1]
    req.token_ids = [4, 5, 6, 4, 5]
    assert d.propose(req, 1) == [6]


def test_suffix_index_is_per_namespace_and_bounded() -> None:
    idx = SuffixIndex(max_tokens=20)
    idx.add("tenant-a", [1, 2, 3, 4, 5, 6])
    idx.add("tenant-b", [1, 2, 9, 9, 9, 9])
    assert idx.lookup("tenant-a", [7, 1, 2], 3) == [3, 4, 5]
    assert idx.lookup("tenant-b", [7, 1, 2], 3) == [9, 9, 9]
    assert idx.lookup(None, [7, 1, 2], 3) == []  # no text of another namespace
    idx.add("tenant-a", [5, 5, 5, 5, 5, 5, 5, 5, 5, 5])  # 22 tokens: the oldest goes
    assert idx.num_tokens == 16
    assert idx.lookup("tenant-a", [1, 2], 3) == []
    assert set(idx.namespaces()) == {"tenant-a", "tenant-b"}


def test_radix_drafter_indexes_prompts_then_outputs() -> None:
    d = make_drafter("radix")
    assert isinstance(d, RadixDrafter)
    first = Req("a", [1, 2, 3, 4], prompt_len=4)
    d.prompt_cached(first)
    other = Req("b", [9, 9, 2, 3], prompt_len=4)
    assert d.propose(other, 2) == [4]  # from a's prompt
    first.token_ids += [20, 21, 22]
    d.finished(first)  # prompt + output in the index now
    assert d.propose(other, 3) == [4, 20, 21]
    assert d.propose(Req("c", [9, 2, 3], 3, namespace="salted"), 3) == []
    d.finished(other)  # never reported its prompt: indexed whole if it has output
    assert d.tracked == 0


def test_radix_drafter_drafts_from_the_requests_own_output_as_it_decodes() -> None:
    """A request's output is indexed while it decodes (the suffix-decoding design): an answer
    repeating its own earlier line drafts from it before the request has finished, beside
    what earlier requests answered, and nothing is indexed twice when it finishes."""
    d = RadixDrafter()
    earlier = Req("a", [1, 2, 3, 50, 51, 52], prompt_len=3)
    d.prompt_cached(earlier)
    d.finished(earlier)  # 1 2 3 -> 50 51 52 in the index
    req = Req("b", [7, 8], prompt_len=2)
    d.prompt_cached(req)
    req.token_ids += [1, 2, 3, 60, 61, 9, 1, 2, 3]  # its own output: "1 2 3 60 61", then again
    # Both earlier "1 2 3"s agree with the context's last three tokens: the tie goes to the
    # most recent, the request's own line (indexed at this proposal), not the earlier answer.
    assert d.propose(req, 3) == [60, 61, 9]
    req.token_ids += [60, 61]
    assert d.propose(req, 4) == [9, 1, 2, 3]  # the new tokens were indexed at the last step
    assert d.index.num_tokens == 6 + 13
    d.finished(req)
    assert d.tracked == 0
    # Its output stays in the index for later requests, once (no token indexed twice).
    assert d.index.num_tokens == 6 + 13
    assert d.propose(Req("c", [61, 9, 1], prompt_len=3), 2) == [2, 3]


def test_adaptive_k_grows_shrinks_and_backs_off() -> None:
    k = AdaptiveK(8)
    assert k.budget(0) == 8
    k.update(8, 2, step=1)
    assert k.budget(2) == 3  # what stood, plus one
    k.update(3, 3, step=2)
    assert k.budget(3) == 6  # all stood: doubles
    k.update(6, 6, step=3)
    assert k.budget(4) == 8  # capped
    for step in range(4, 4 + MIN_VERIFIES + 2):  # drafts keep failing: off for a while
        if k.budget(step):
            k.update(k.budget(step), 0, step)
    off_at = next(s for s in range(100) if k.budget(s) == 0 and s > 4)
    assert k.budget(off_at + FIRST_BACKOFF + MIN_VERIFIES + 2) == 1  # back, carefully
