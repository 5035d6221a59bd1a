"""benchmarks/bench_draft_tree.py: the replay that sets a token tree against the chain, on
hand-made outputs whose best match is wrong and whose second is right."""

from __future__ import annotations

from bench_modules import load

from radixserve.speculative.suffix_index import SuffixIndex

bench = load("bench_draft_tree.py", "bench_draft_tree")


def test_trie_nodes_count_shared_prefixes_once() -> None:
    assert bench.trie_nodes([[1, 2, 3], [1, 2, 4], [5]]) == 5
    assert bench.trie_nodes([]) == 0


def test_candidates_are_distinct_and_best_first() -> None:
    index = SuffixIndex()
    index.add(None, [7, 8, 1, 2, 3])
    index.add(None, [9, 7, 8, 4, 5])  # the longer match of the context [9, 7, 8]: first
    assert index.candidates(None, [9, 7, 8], 2, 4) == [[4, 5], [1, 2]]
    assert index.candidates(None, [9, 7, 8], 2, 1) == [index.lookup(None, [9, 7, 8], 2)]
    assert index.candidates("other", [9, 7, 8], 2, 4) == []


def test_a_second_branch_is_accepted_where_the_best_one_fails() -> None:
    # Two earlier answers continue "7 8" differently; the request quotes the older one,
    # while the newer one (most recent, so the chain's pick among equal matches) is wrong.
    requests = [
        {"workload": "w", "prompt": [1], "output": [7, 8, 20, 21, 22, 23]},
        {"workload": "w", "prompt": [2], "output": [7, 8, 30, 31, 32, 33]},
        {"workload": "w", "prompt": [3], "output": [7, 8, 20, 21, 22, 23]},
    ]
    chain = bench.replay(requests, k=4, branches=1)["w"]
    tree = bench.replay(requests, k=4, branches=2)["w"]
    assert chain["tokens"] == tree["tokens"] == 18
    assert tree["steps"] < chain["steps"] and tree["rows"] > 0
