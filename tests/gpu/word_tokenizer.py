"""A tokenizer for random-weight GPU tests: token i is the word `t<i>`, so any id sequence
is a prompt and decodes back to text without a real vocabulary."""

from __future__ import annotations

from text.tokenizer import Tokenizer


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Words t0 .. t<vocab_size - 1>, split on whitespace; t0 is the end of sequence."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                       unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(0,), add_bos_token=False,
                     chat_template=None, special_token_strings={})
