"""Compiling constraints against a tokenizer, with a cache per (tokenizer, constraint).

The library is xgrammar (chosen by measurement, see docs/): it compiles a regex or a
JSON schema into a pushdown automaton whose per-state token masks are precomputed against
the vocabulary, so a per-step mask costs tens of microseconds. Compilation is paid once per
distinct constraint; :class:`GrammarCompiler` keeps an LRU of compiled grammars, and
:func:`compiler_for` keeps one compiler per tokenizer object (building the vocabulary
tables of a 49k-token tokenizer takes a few hundred milliseconds).

::

    SamplingParams(regex=...)  ──constraint_of──>  Constraint(kind, value)   (hashable key)
                                                          │  GrammarCompiler.compile (LRU)
                                                          v
                                                   CompiledGrammar ──new_matcher──> GrammarMatcher (per request)
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import xgrammar as xgr

from radixserve.constrained.matcher import GrammarMatcher
from radixserve.constrained.spec import CompiledGrammar, Constraint
from radixserve.constrained.utf8 import SurrogateGuard

#: The longest one grammar compilation may take (see :class:`GrammarCompiler`); the
#: worker's loop waits for it, so it bounds how long one request can stall the others.
DEFAULT_COMPILE_TIMEOUT_S = 5.0

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users want the rest.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class CompilerStats(NamedTuple):
    hits: int
    misses: int
    cached: int


class GrammarCompiler:
    """Compiles :class:`Constraint` s for one tokenizer; thread-safe, with an LRU cache.

    ``vocab_size`` is the model's logits width (may exceed the tokenizer's own size: the
    padding ids are never allowed). ``stop_token_ids``: the tokens that end a generation
    (the model's EOS ids); a constrained request may sample them only where its grammar
    can end. ``compile_timeout_s``: the longest one compilation may take (xgrammar
    releases the GIL while it compiles, so it runs on a thread of its own and the caller
    stops waiting at the limit; the constraint is then refused at once if asked again).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        max_threads: int | None = None,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        info_kw: dict[str, Any] = {"vocab_size": vocab_size}
        if self.stop_token_ids:
            info_kw["stop_token_ids"] = list(self.stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, **info_kw)
        self.guard = SurrogateGuard.from_vocab(self.tokenizer_info.decoded_vocab, vocab_size)
        threads = max_threads if max_threads is not None else min(4, os.cpu_count() or 1)
        # Our own LRU below is the cache (it counts hits and bounds entries); xgrammar's is off.
        self._xgr = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=threads, cache_enabled=False
        )
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self.compile_timeout_s = compile_timeout_s
        self._too_slow: OrderedDict[Constraint, None] = (
            OrderedDict()
        )  # timed out once: refused at once

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled grammar of ``constraint`` (cached). Raises ``ValueError`` with the
        library's reason when the regex or schema is invalid or unsupported."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                self._hits += 1
                return hit
            self._misses += 1
            if constraint in self._too_slow:
                raise ValueError(self._too_slow_message(constraint))
        compiled = CompiledGrammar(
            constraint,
            self._compile_bounded(constraint),
            self.vocab_size,
            self.stop_token_ids,
            self.guard,
        )
        with self._lock:
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher:
        """Compile (or fetch) ``constraint`` and start a matcher at its beginning."""
        return GrammarMatcher(self.compile(constraint))

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(self._hits, self._misses, len(self._cache))

    def _too_slow_message(self, c: Constraint) -> str:
        return (
            f"the {c.kind} is too complex: compiling it took longer than the limit of "
            f"{self.compile_timeout_s:g} s ({c.describe()})"
        )

    def _compile_bounded(self, c: Constraint) -> Any:
        """:meth:`_compile` with the time limit: past it, ``ValueError`` (the compile thread
        finishes on its own in the background; its result is dropped)."""
        if self.compile_timeout_s <= 0:
            return self._compile(c)
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["grammar"] = self._compile(c)
            except BaseException as exc:  # handed to the waiting caller
                box["error"] = exc

        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        thread.start()
        thread.join(self.compile_timeout_s)
        if thread.is_alive():
            with self._lock:
                self._too_slow[c] = None
                while len(self._too_slow) > self._cache_size:
                    self._too_slow.popitem(last=False)
            raise ValueError(self._too_slow_message(c))
        if "error" in box:
            raise box["error"]
        return box["grammar"]

    def _compile(self, c: Constraint) -> Any:
        try:
            if c.kind == "regex":
                assert isinstance(c.value, str)
                return self._xgr.compile_regex(c.value)
            if c.kind == "json_schema":
                assert isinstance(c.value, str)
                return self._xgr.compile_grammar(json_schema_grammar(c.value))
            if c.kind == "tagged_json":
                assert isinstance(c.value, str)
                return self._xgr.compile_grammar(tagged_json_grammar(c.value))
            if c.kind == "structural_tag":
                assert isinstance(c.value, str)
                return self._xgr.compile_grammar(structural_tag_grammar(c.value))
            if c.kind == "ebnf":
                assert isinstance(c.value, str)
                return self._xgr.compile_grammar(c.value)
            if c.kind == "choices":
                # A grammar of string literals (JSON escapes are EBNF escapes), not a regex:
                # no character of a choice needs regex escaping.
                ebnf = "root ::= " + " | ".join(json.dumps(s, ensure_ascii=True) for s in c.value)
                return self._xgr.compile_grammar(ebnf)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidStructuralTagError) as e:
            reason = _CPP_PREFIX.sub("", str(e).strip()).strip()
            raise ValueError(f"invalid {c.kind}: {reason} ({c.describe()})") from None
        raise ValueError(f"unknown constraint kind {c.kind!r}")


# xgrammar 0.2.9 spells the characters of a length-limited string (minLength/maxLength) as
# [^"\\\r\n], which lets raw control characters through, and RFC 8259 (and json.loads)
# reject those; its unlimited strings already exclude \0-\x1f. Same class, minus controls.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def json_schema_grammar(schema: str) -> Any:
    """The xgrammar ``Grammar`` of a JSON schema, as compact JSON that ``json.loads`` accepts.

    Compact: ", " and ": " separators and no free whitespace, so a model cannot spin on
    whitespace and a bounded schema has a bounded length.
    """
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR))


def tagged_json_grammar(spec: str) -> Any:
    """``begin`` + a JSON value of ``schema`` (as :func:`json_schema_grammar` spells it) +
    ``end``: a tool call forced into the markup of the model's own format."""
    parsed = json.loads(spec)
    parts = []
    for key in ("begin", "end"):
        text = parsed.get(key, "")
        if text:
            parts.append((key, xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))))
    body = json_schema_grammar(json.dumps(parsed["schema"]))
    begin = [g for k, g in parts if k == "begin"]
    end = [g for k, g in parts if k == "end"]
    grammars = [*begin, body, *end]
    return grammars[0] if len(grammars) == 1 else xgr.Grammar.concat(*grammars)


def structural_tag_grammar(spec: str) -> Any:
    """The xgrammar ``Grammar`` of a structural tag, each ``json_schema`` content spelled as
    :func:`json_schema_grammar` spells it (compact, no raw control characters), so a call's
    arguments look the same forced, strict or unforced."""
    parsed = json.loads(spec)
    return xgr.Grammar.from_structural_tag(json.dumps(_compact_contents(parsed)))


def _compact_contents(node: Any) -> Any:
    if isinstance(node, list):
        return [_compact_contents(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        grammar = json_schema_grammar(json.dumps(node.get("json_schema", True)))
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _compact_contents(v) for k, v in node.items()}


_compilers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], GrammarCompiler]] = (
    weakref.WeakKeyDictionary()
)
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarCompiler:
    """One shared :class:`GrammarCompiler` per tokenizer object (and logits width, stop ids)."""
    key = (int(vocab_size), tuple(int(t) for t in stop_token_ids))
    with _compilers_lock:
        per_tok = _compilers.setdefault(tokenizer, {})
        compiler = per_tok.get(key)
        if compiler is None:
            compiler = per_tok[key] = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        return compiler
