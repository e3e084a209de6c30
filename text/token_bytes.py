"""Each token's bytes, for vocabularies whose decoder only concatenates bytes (byte-level BPE).

A byte-level BPE vocabulary (GPT-2, Llama 3, Qwen2, SmolLM2) spells every byte as one
printable character. `tokenizers`' ByteLevel decoder turns each token back into its bytes
(a token with a character outside that alphabet, e.g. an added token's text, is taken as
its own UTF-8) and decodes the concatenation as UTF-8, lossily. So the text of any id
sequence is `b"".join(table[i] for i in ids).decode("utf-8", "replace")`, and a stream of
tokens can be turned into text with one table lookup and an incremental UTF-8 decoder per
token (text/byte_detokenizer.py) instead of a decode of a window of ids.

`TokenBytes.try_build` builds the table only where that identity holds: the decoder is
exactly ByteLevel, and every id's bytes decode to what the tokenizer itself decodes for
that id alone (checked for the whole vocabulary when the table is built). Anything else
(SentencePiece decoders with byte fallback and space markers, say) gets None: the caller
keeps decoding windows.

Special tokens: with `skip_special_tokens` their bytes are empty, as the tokenizer drops
them from a decode. Ids past the table (a model's embedding padded beyond the vocabulary)
have no text either, as in a decode.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {}
    num_moved = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + num_moved)] = byte
            num_moved += 1
    return chars


def _token_bytes(token: str, byte_of_char: dict[str, int]) -> bytes:
    """What the ByteLevel decoder makes of one token."""
    try:
        return bytes(byte_of_char[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class TokenBytes:
    """Immutable: `table[token_id]` is that token's bytes; `texts[token_id]` their text
    where they are whole UTF-8 characters on their own (most tokens), else None (a token
    that starts or ends mid-character, or holds invalid bytes)."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.texts = [_whole_text(data) for data in table]

    def __len__(self) -> int:
        return len(self.table)

    def text(self, token_ids: list[int]) -> str:
        """The decode of `token_ids` (what the tokenizer's own decode returns)."""
        size = len(self.table)
        return b"".join(self.table[i] for i in token_ids if 0 <= i < size).decode(
            "utf-8", "replace")

    @classmethod
    def try_build(cls, backend: tokenizers.Tokenizer,
                  skip_special_tokens: bool = True) -> TokenBytes | None:
        """The table of `backend`, or None where its decoder is not plain ByteLevel or
        some id's bytes do not decode as the tokenizer decodes that id."""
        if type(backend.decoder) is not decoders.ByteLevel:  # a Sequence of steps, say
            return None
        byte_of_char = _byte_of_char()
        size = backend.get_vocab_size(with_added_tokens=True)
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        table: list[bytes] = []
        for token_id in range(size):
            token = backend.id_to_token(token_id)
            if token is None or (skip_special_tokens and token_id in special):
                table.append(b"")
            else:
                table.append(_token_bytes(token, byte_of_char))
        decoded = backend.decode_batch([[i] for i in range(size)],
                                       skip_special_tokens=skip_special_tokens)
        for token_id, text in enumerate(decoded):
            if table[token_id].decode("utf-8", "replace") != text:
                return None
        return cls(table)
