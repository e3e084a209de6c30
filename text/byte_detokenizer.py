"""Incremental detokenization for byte-level vocabularies: a table lookup and a UTF-8 decoder.

Where the tokenizer's text is the lossy UTF-8 decode of its tokens' concatenated bytes
(text/token_bytes.py), streaming needs no window of ids: each token's bytes go into an
incremental UTF-8 decoder, which returns every character they complete and keeps the
bytes of an incomplete one until the bytes that complete it (or prove it invalid) arrive.

    token -> table[token] -> utf8.decode(bytes, final=False) -> new text ("" while incomplete)
    finish               -> utf8.decode(b"", final=True)     -> a held incomplete tail as U+FFFD

While no byte is held, a token whose bytes are whole characters (`TokenBytes.texts`, most
tokens) is its own text, as the decoder would return it: one lookup, the decoder untouched
(about 3x cheaper per token, and a step adds one token to every running request).

Against text/detokenizer.py's window decode, the text is the same (the deltas concatenate
to the tokenizer's decode of the output); invalid bytes come out as U+FFFD as soon as they
are known to be invalid, where a window decode holds any text that ends in U+FFFD until a
later token. Output never depends on the prompt: a prompt ending mid-character is not glued
to the output's bytes (the window decode drops such a prompt from its context too).

Lifecycle: constructed per request -> `add` once per sampled token -> `flush` once when the
request finishes.

Invariants: the concatenation of all deltas equals `TokenBytes.text(output_ids)`; no byte
is held once `flush` ran; `_holding` says whether the decoder holds bytes.
"""

from __future__ import annotations

import codecs

from text.token_bytes import TokenBytes


class ByteDetokenizer:
    """Per-request streaming state. Not thread-safe; one per request."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._table = token_bytes.table
        self._texts = token_bytes.texts
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._holding = False  # the decoder holds the bytes of an incomplete character
        self._finished = False

    @property
    def num_held_bytes(self) -> int:
        """Bytes of an incomplete character waiting for the rest of it."""
        return len(self._utf8.getstate()[0])

    def add(self, token_id: int) -> str:
        """Appends one sampled token; returns the text it completes (often "" or one piece)."""
        if self._finished:
            raise RuntimeError("add() after flush(): the request already finished")
        try:
            if not self._holding and (text := self._texts[token_id]) is not None:
                return text  # whole characters after whole characters: the decoder's answer
            data = self._table[token_id]
        except IndexError:  # past the vocabulary (a padded embedding): no text, as a decode
            return ""
        text = self._utf8.decode(data)
        self._holding = bool(self._utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """Called exactly once when the request finishes: releases held bytes as decoded."""
        if self._finished:
            raise RuntimeError("flush() called twice")
        self._finished = True
        self._holding = False
        return self._utf8.decode(b"", final=True)

    def check_invariants(self) -> None:
        held = self.num_held_bytes
        assert held < 4, f"{held} bytes held: no UTF-8 character is that long"
        assert not (self._finished and held), "bytes held after flush()"
        assert self._holding == bool(held) or self._finished, \
            f"holding {self._holding} with {held} bytes held"
