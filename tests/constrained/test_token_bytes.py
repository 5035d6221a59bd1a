"""Token bytes and where a character ends: what a thinking budget reads so as not to close
its block in the middle of a character (radixserve.token_bytes)."""

from __future__ import annotations

import codecs
from pathlib import Path

from hypothesis import assume, given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.token_bytes import TokenBytes, pending_bytes


def _python_pending(data: bytes) -> bool:
    """Whether Python's incremental UTF-8 decoder holds back an unfinished character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data)
    return bool(decoder.getstate()[0])


# Bytes a character may start or go on with, and ASCII, drawn often enough to make
# characters whole, cut, or malformed.
_BYTES = st.one_of(st.integers(0x00, 0x7F), st.integers(0x80, 0xBF), st.integers(0xC0, 0xFF)).map(
    lambda b: bytes([b])
)


@given(st.lists(_BYTES, max_size=8).map(b"".join))
def test_an_unfinished_character_is_found_as_pythons_decoder_finds_it(data: bytes) -> None:
    """The same verdict as CPython's decoder, but for the surrogates' prefixes (ED A0..BF),
    which that decoder holds back and Unicode's table counts ill-formed at once."""
    assume(not (data[-2:-1] == b"\xed" and 0xA0 <= data[-1] <= 0xBF))
    assert (pending_bytes(data) > 0) == _python_pending(data)


def test_bytes_still_needed() -> None:
    assert pending_bytes(b"") == 0
    assert pending_bytes("a世".encode()[:2]) == 2
    assert pending_bytes("a世".encode()[:3]) == 1
    assert pending_bytes("a世".encode()) == 0
    assert pending_bytes("🙂".encode()[:1]) == 3
    assert pending_bytes(b"\xc3") == 1
    assert pending_bytes(b"\xe0\x80") == 0  # an overlong form: nothing can finish it
    assert pending_bytes(b"\x80\x80") == 0  # no lead byte


def test_a_texts_tokens_bytes_join_into_its_utf8(tiny_llama_dir: Path) -> None:
    """Byte-level BPE splits characters the tiny vocabulary lacks over byte tokens; their
    bytes together are the text's, and a cut inside a character is seen as one."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    of = TokenBytes(tok)
    text = "héllo 世界 🙂!"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(of(t) for t in ids) == text.encode()
    cuts = [pending_bytes(b"".join(of(t) for t in ids[:i])) for i in range(len(ids) + 1)]
    assert any(cuts) and cuts[-1] == 0
