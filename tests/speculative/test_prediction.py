"""Drafting from a prediction (OpenAI's predicted outputs), on plain token lists: the
answer followed while it agrees, found again after an edit, the server's drafter where
the prediction has nothing to say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_drafters import Req

from radixserve.speculative.ngram import NgramDrafter
from radixserve.speculative.prediction import MIN_MATCH, PredictionDrafter, PredictionTrack

PROMPT = [900, 901, 902]


def _req(output: list[int], prediction: list[int] | None) -> Req:
    return Req("r", PROMPT + output, len(PROMPT), prediction=prediction)


def test_the_answer_is_followed_while_it_agrees() -> None:
    d = PredictionDrafter(None)
    prediction = [10, 11, 12, 13, 14, 15]
    req = _req([], prediction)
    assert d.propose(req, 3) == [10, 11, 12]  # nothing decoded yet: from its start
    req.token_ids += [10, 11]
    assert d.propose(req, 3) == [12, 13, 14]
    req.token_ids += [12, 13, 14, 15]
    assert d.propose(req, 3) == []  # the prediction is used up
    d.finished(req)
    assert d.tracked == 0


def test_an_edit_is_left_then_the_answer_is_found_again_after_it() -> None:
    # The prediction says "a b c d e f g h i j k"; the answer changes "c d" into "x y z".
    a, b, c, d_, e, f, g, h, i, j, k = range(20, 31)
    x, y, z = 40, 41, 42
    d = PredictionDrafter(None)
    req = _req([a, b], [a, b, c, d_, e, f, g, h, i, j, k])
    assert d.propose(req, 2) == [c, d_]
    req.token_ids += [x]  # off the prediction: no draft while its last tokens are not in it
    assert d.propose(req, 2) == []
    req.token_ids += [y, z, e, f, g, h]
    assert d.propose(req, 2) == []  # "e f g h" is, but four tokens are too weak a sign
    req.token_ids += [i]
    assert d.propose(req, 2) == [j, k]  # "e f g h i" agrees over MIN_MATCH: on from there
    assert MIN_MATCH == 5


def test_the_answer_may_begin_the_prediction_after_a_preamble() -> None:
    # A fence, then the code the prediction starts with: all of it before the place agrees.
    fence, lang = 60, 61
    d = PredictionDrafter(None)
    req = _req([fence, lang], [1, 2, 3, 4, 5])
    assert d.propose(req, 2) == []
    req.token_ids += [1, 2]
    assert d.propose(req, 2) == [3, 4]


def test_of_equal_places_the_one_after_the_edit_wins() -> None:
    # "r s t p q" occurs twice, the second after the place the answer left; equal agreement.
    r, s, t, p, q = 6, 7, 8, 9, 10
    prediction = [r, s, t, p, q, 1, 2, 3, 4, r, s, t, p, q, 5, 6]
    track = PredictionTrack(prediction, prompt_len=0)
    assert track.follow([r, s, t, p, q, 1, 2]) == 7
    assert track.follow([r, s, t, p, q, 1, 2, 70, r, s, t, p, q]) == 14
    assert track.draft(2) == [5, 6]


def test_longer_agreement_wins_over_order() -> None:
    prediction = [1, 2, 3, 4, 7, 8, 100, 9, 10, 11, 12, 7, 8, 200]
    track = PredictionTrack(prediction, prompt_len=0)
    # The answer's last tokens "9 10 11 12 7 8" agree with the second "7 8" over six.
    assert track.follow([50, 9, 10, 11, 12, 7, 8]) == 13
    assert track.draft(4) == [200]


@pytest.mark.parametrize("with_base", [False, True])
def test_where_the_prediction_cannot_the_fallback_drafts(with_base: bool) -> None:
    """The server's drafter, or prompt lookup over the request's own text without one; a
    request without a prediction drafts only with the server's drafter."""
    base = NgramDrafter() if with_base else None
    d = PredictionDrafter(base)
    quoting = Req("q", [1, 2, 3, 4, 1, 2], 6)  # no prediction; its prompt quotes itself
    assert d.drafts_for(quoting) is with_base
    assert d.propose(quoting, 2) == ([3, 4] if with_base else [])
    predicted = Req("p", [1, 2, 3, 4, 1, 2], 6, prediction=[3, 5])
    assert d.drafts_for(predicted)
    assert d.propose(predicted, 2) == [3, 5]  # the prediction comes first
    predicted.token_ids += [3, 4]  # off it: what followed "3 4" in its own text
    assert d.propose(predicted, 2) == [1, 2]
    for r in (quoting, predicted):
        d.finished(r)
    d.check_invariants([])
    assert d.tracked == 0 and (base is None or base.tracked == 0)


def test_a_request_cut_back_is_followed_afresh() -> None:
    d = PredictionDrafter(None)
    req = _req([10, 11, 12], [10, 11, 12, 13])
    assert d.propose(req, 1) == [13]
    req.token_ids = PROMPT + [10]  # fewer tokens than seen (retracted and recomputed)
    assert d.propose(req, 2) == [11, 12]
    with pytest.raises(AssertionError, match="requests that left"):
        d.check_invariants([])


def _rejoin_reference(prediction: list[int], context: list[int], last: int) -> int | None:
    """Every place, plainly: the agreement of each, capped; the longest; of equals the first
    past ``last``, else the first."""
    from radixserve.speculative import prediction as pm

    scored = []
    for p in range(2, len(prediction) + 1):
        if prediction[p - 2 : p] != context[-2:]:
            continue
        length = 0
        while (
            length < min(p, len(context), pm.MAX_MATCH)
            and prediction[p - 1 - length] == context[-1 - length]
        ):
            length += 1
        if length == p:
            length = max(length, pm.MIN_MATCH)
        scored.append((length, p))
    if not scored or max(s for s, _ in scored) < pm.MIN_MATCH:
        return None
    best = max(s for s, _ in scored)
    tied = [p for s, p in scored if s == best]
    after = [p for p in tied if p > last]
    return (after or tied)[0]


@settings(max_examples=400)
@given(
    prediction=st.lists(st.integers(0, 3), min_size=2, max_size=40),
    context=st.lists(st.integers(0, 3), min_size=2, max_size=20),
    last=st.integers(0, 40),
)
def test_rejoin_is_the_plain_rule(prediction: list[int], context: list[int], last: int) -> None:
    """Over a four-token alphabet (places recur, agreements tie): the indexed look-up picks
    the place the rule names, looked at every place."""
    track = PredictionTrack(prediction, prompt_len=0)
    track.last = last
    assert track._rejoin(context) == _rejoin_reference(prediction, context, last)
