"""Incremental detokenization for streaming: one token in, the new text out.

`new_detokenizer` picks the implementation: byte-level vocabularies stream through a table
of each token's bytes (text/byte_detokenizer.py); the window decode below serves the
rest (SentencePiece decoders, for instance).

Decoding each token alone is wrong twice over: a byte-level token may hold only part of a
multi-byte UTF-8 character (the decoder then yields U+FFFD), and some decoders change a
token's text depending on what precedes it (SentencePiece drops a leading space at the start).
So each step decodes a short window of ids and emits what the new token added to it:

    ids       [ ... prompt/output ... | context     | pending       ]
                                      ^prefix_offset ^read_offset   ^len(ids)
    context   tokens whose text is already emitted; decoded again only so that the new
              tokens are decoded in context
    pending   tokens whose text is not yet (fully) emitted

    new_text = decode(ids[prefix_offset:]);  prefix_text = decode(ids[prefix_offset:read_offset])
    if new_text ends in U+FFFD, a character is still incomplete: emit nothing, wait for bytes
    else emit new_text[len(prefix_text):] and advance: read_offset = len(ids), and
         prefix_text = new_text (the decode of the same window: no second decode); once the
         context holds more than _MAX_CONTEXT_TOKENS, slide: the context becomes the run
         just emitted (decoded once more, on its own)

Cost per token is one decode of O(window) ids, the window being the context (at most
_MAX_CONTEXT_TOKENS + the last emitted run) plus the pending tokens. Pending tokens pile up
only while the text keeps ending in an incomplete character, i.e. for invalid UTF-8
output; any token that completes a character clears them.

Lifecycle: constructed with the prompt ids (the context for the first output token) ->
`add` once per sampled token -> `flush` once when the request finishes, which releases
an incomplete trailing character as U+FFFD exactly as a full decode would.

Invariants: for byte-level vocabularies, the concatenation of all deltas returned by `add`
and `flush` equals `tokenizer.decode(output_ids)` (held bytes never leak out broken);
`prefix_offset <= read_offset <= len(ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from text.byte_detokenizer import ByteDetokenizer

if TYPE_CHECKING:
    from text.tokenizer import Tokenizer

# Prompt tokens used as context for the first output token: enough for any decoder's
# look-behind (a leading space, a byte sequence), small enough to stay cheap.
_NUM_CONTEXT_TOKENS = 5
# Emitted tokens kept as context before the window slides: a slide costs one more decode,
# a longer window a longer one; 8 makes slides rare and windows short.
_MAX_CONTEXT_TOKENS = 8
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer(Protocol):
    """What streaming needs of a detokenizer (IncrementalDetokenizer, ByteDetokenizer)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...

    def check_invariants(self) -> None: ...


def new_detokenizer(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> Detokenizer:
    """The detokenizer of one request: a table lookup per token where the vocabulary is
    byte-level (text/byte_detokenizer.py), else a decode of a window of ids. Every side
    that streams a request's text (the engine, the gateway's first token of a handoff)
    makes its detokenizer here, so that their deltas split the text at the same places."""
    token_bytes = tokenizer.token_bytes()
    if token_bytes is not None:
        return ByteDetokenizer(token_bytes)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class IncrementalDetokenizer:
    """Per-request streaming state. Not thread-safe; one per request."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT):
            # The prompt ends mid-character; do not glue output bytes onto it.
            self._ids.clear()
            self._read_offset = 0
            self._prefix_text = ""
        self._finished = False

    @property
    def num_pending_tokens(self) -> int:
        """Output tokens whose text is held back (an incomplete character)."""
        return len(self._ids) - self._read_offset

    def add(self, token_id: int) -> str:
        """Appends one sampled token; returns the text it completes (often "" or one piece)."""
        if self._finished:
            raise RuntimeError("add() after flush(): the request already finished")
        ids = self._ids
        ids.append(token_id)
        new_text = self._tokenizer.decode(ids[self._prefix_offset:] if self._prefix_offset
                                          else ids, skip_special_tokens=self._skip_special_tokens)
        if new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text):
            # Incomplete character, or a token with no text (a skipped special token): wait.
            # Nothing is emitted, so the window is not slid either.
            return ""
        delta = new_text[len(self._prefix_text):]
        run_start, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = new_text  # decode(ids[prefix_offset:read_offset]), just computed
        if self._read_offset - self._prefix_offset > _MAX_CONTEXT_TOKENS:
            self._slide(run_start)
        return delta

    def flush(self) -> str:
        """Called exactly once when the request finishes: releases held text as decoded."""
        if self._finished:
            raise RuntimeError("flush() called twice")
        self._finished = True
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(self._prefix_text):]
        self._read_offset = len(self._ids)
        return delta

    def check_invariants(self) -> None:
        assert 0 <= self._prefix_offset <= self._read_offset <= len(self._ids), (
            self._prefix_offset, self._read_offset, len(self._ids))
        assert self._prefix_text == self._decode(self._ids[self._prefix_offset:self._read_offset])

    def _slide(self, run_start: int) -> None:
        """Keep only the last emitted run as context (decoded once more, on its own)."""
        self._prefix_offset = run_start
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        # Drop ids that will never be decoded again, keeping the list O(window) long.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
