"""The ``radix`` drafter: continuations from what the radix cache was given, per namespace.

The radix tree holds every token sequence recently computed (prompts and outputs of earlier
requests, chat history, a forked program's trunk), but it is keyed by whole prefixes: it
answers "what follows this exact context", not "what followed these last few tokens,
wherever they occurred", which is what drafting needs (a quote from a document in the middle
of the prompt, an earlier answer repeated in a later turn). So the drafter keeps a bounded
suffix index fed by the same sequences the scheduler inserts into the tree::

    prompt computed (its pages inserted)   -> the prompt is indexed, as one sequence
    each proposal while it decodes         -> that sequence grown by its new output tokens
    request left (prompt + output inserted) -> that sequence extended with the rest

and looks the request's last tokens up in it (:class:`~radixserve.speculative.ngram_table.
NgramTable`). Each cache namespace (tenant salt) has its own table and sequences: a request
drafts only from text of its own namespace, so how fast its drafts are accepted never tells
it anything about another tenant's text. The index holds at most ``max_tokens`` tokens over
all namespaces, the oldest sequences forgotten first; it follows the tree's insertions, not
its evictions (a continuation may outlive its pages: it is still only ever a guess that the
model verifies).

A request's own output is indexed as it decodes, as vLLM's suffix decoding keeps a tree of
the request's own text beside the global one: an answer that repeats itself (a list, a
loop, code with a line pattern) drafts from its own earlier lines, and an answer quoting an
earlier request's answer drafts from that one, in one look-up that picks the longest match
of either (benchmarks/agents.md has its acceptance on each workload).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from radixserve.speculative.drafter import Drafter, DraftSource
from radixserve.speculative.ngram_table import KEY, NgramTable

__all__ = ["RadixDrafter", "SuffixIndex"]

DEFAULT_MAX_TOKENS = 1 << 20


class _Space:
    """One namespace's sequences and their table."""

    def __init__(self) -> None:
        self.table = NgramTable()
        self.seqs: dict[int, list[int]] = {}


class SuffixIndex:
    """Token sequences by namespace, with a table of their continuations."""

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._spaces: dict[Hashable | None, _Space] = {}
        self._order: OrderedDict[int, Hashable | None] = OrderedDict()  # oldest first
        self._next_id = 0

    def add(self, namespace: Hashable | None, tokens: list[int], skip: int = 0) -> int:
        """Index ``tokens`` (a copy is kept) as a new sequence; positions before ``skip`` are
        not indexed (a cached prefix indexed with the sequence it came from). Returns its id."""
        seq_id = self._next_id
        self._next_id += 1
        space = self._spaces.setdefault(namespace, _Space())
        space.seqs[seq_id] = list(tokens)
        space.table.add(seq_id, tokens, max(0, skip - KEY), len(tokens))
        self._order[seq_id] = namespace
        self.num_tokens += len(tokens)
        self._trim()
        return seq_id

    def grow(self, seq_id: int, tokens: list[int]) -> None:
        """``tokens`` is sequence ``seq_id`` grown longer by a decoding step or a few: index
        the new tail. Only the boundary token is checked (the caller's sequence only ever
        grows), so a step costs its new tokens, not the context's length; a sequence that
        does not continue there is left as it is."""
        found = self._sequence(seq_id)
        if found is not None:
            old = found[1]
            if len(tokens) > len(old) and (not old or tokens[len(old) - 1] == old[-1]):
                self._append(found[0], seq_id, tokens[len(old) :])

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """``tokens`` is sequence ``seq_id`` grown longer: index what is new (a forgotten
        sequence is left forgotten, one that ``tokens`` does not start with as it is)."""
        found = self._sequence(seq_id)
        if found is not None:
            old = found[1]
            if len(tokens) > len(old) and tokens[: len(old)] == old:
                self._append(found[0], seq_id, tokens[len(old) :])

    def _sequence(self, seq_id: int) -> tuple[_Space, list[int]] | None:
        """Sequence ``seq_id``'s namespace and tokens, or None once it is forgotten."""
        if seq_id not in self._order:
            return None
        space = self._spaces[self._order[seq_id]]
        return space, space.seqs[seq_id]

    def _append(self, space: _Space, seq_id: int, new: list[int]) -> None:
        seq = space.seqs[seq_id]
        start = len(seq)
        seq.extend(new)
        space.table.add(seq_id, seq, start, len(seq))
        self.num_tokens += len(new)
        self._order.move_to_end(seq_id)
        self._trim()

    def lookup(self, namespace: Hashable | None, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed ``context``'s last tokens in ``namespace``."""
        space = self._spaces.get(namespace)
        if space is None:
            return []
        match = space.table.best(context, space.seqs)
        if match is None:
            return []
        return space.seqs[match.seq][match.pos : match.pos + k]

    def candidates(
        self, namespace: Hashable | None, context: list[int], k: int, n: int
    ) -> list[list[int]]:
        """Up to ``n`` different continuations of up to ``k`` tokens that followed
        ``context``'s last tokens in ``namespace``, the best match first (a token tree's
        branches; :meth:`lookup` is the first)."""
        space = self._spaces.get(namespace)
        if space is None:
            return []
        out: list[list[int]] = []
        for match in space.table.ranked(context, space.seqs):
            cont = space.seqs[match.seq][match.pos : match.pos + k]
            if cont and cont not in out:
                out.append(cont)
                if len(out) == n:
                    break
        return out

    def _trim(self) -> None:
        while self.num_tokens > self.max_tokens and len(self._order) > 1:
            seq_id, namespace = self._order.popitem(last=False)
            space = self._spaces[namespace]
            tokens = space.seqs.pop(seq_id)
            space.table.remove(seq_id, tokens, len(tokens))
            self.num_tokens -= len(tokens)
            if not space.seqs:
                del self._spaces[namespace]

    def namespaces(self) -> list[Hashable | None]:
        """The namespaces holding sequences now (tests)."""
        return list(self._spaces)


class RadixDrafter(Drafter):
    name = "radix"

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.index = SuffixIndex(max_tokens)
        self._seq_of: dict[str, int] = {}  # request id -> its sequence in the index

    def propose(self, req: DraftSource, k: int) -> list[int]:
        seq_id = self._seq_of.get(req.request_id)
        if seq_id is not None:  # the request's own output so far, indexed before the look-up
            self.index.grow(seq_id, _known(req.token_ids))
        return self.index.lookup(req.namespace, req.token_ids, k)

    def prompt_cached(self, req: DraftSource) -> None:
        if req.request_id not in self._seq_of:
            prompt = req.token_ids[: req.prompt_len]
            self._seq_of[req.request_id] = self.index.add(req.namespace, prompt)

    def finished(self, req: DraftSource) -> None:
        seq_id = self._seq_of.pop(req.request_id, None)
        tokens = _known(req.token_ids)
        if seq_id is not None:
            self.index.extend(seq_id, tokens)
        elif len(tokens) > req.prompt_len:  # finished before its prompt was reported
            self.index.add(req.namespace, tokens)

    @property
    def tracked(self) -> int:
        """Requests with a sequence pending their output (tests: none once all finished)."""
        return len(self._seq_of)


def _known(tokens: list[int]) -> list[int]:
    """``tokens`` up to a placeholder of a step in flight (ids are never negative)."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] >= 0:
            return tokens[: i + 1]
    return []
