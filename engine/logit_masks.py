"""The sampler's edits that a request states as tokens: its grammar's mask and its logit bias.

    grammar rows: matcher.write_mask -> bitmask [rows, ceil(vocab / 32)] int32 (host)
                  -> to the device -> allowed [rows, vocab] bool -> -inf where not allowed
    logit_bias:   (row, token id, bias) triples -> one accumulating index_put on the device

Bit layout (llguidance's, and the usual one): token t is allowed iff bit t % 32 of word
t // 32 is set; bit 31 is an int32's sign bit.

Side-effect free apart from the logits edited in place and the host buffer each call fills.
Every host value reaches the device through `to_device` (engine/device_upload.py): no edit
waits for the step in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.device_upload import to_device
from protocol.sampling_params import LogitBias
from text.grammar import GrammarMatcher


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """In place: -inf for every token a row's matcher does not allow next (rows without a
    matcher untouched). A matcher that has ended (or broke) allows EOS only."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab_size = logits.shape[1]
    num_words = (vocab_size + 31) // 32
    bits = torch.zeros(len(rows), num_words, dtype=torch.int32)
    for j, i in enumerate(rows):
        matcher = matchers[i]
        assert matcher is not None
        if matcher.is_usable:
            matcher.write_mask(bits[j].data_ptr(), num_words * 4)
        else:
            for t in matcher.eos_token_ids:
                if t < vocab_size:
                    bits[j, t // 32] |= _bit(t % 32)
    allowed = allowed_from_bitmask(to_device(bits.numpy(), torch.int32, logits.device),
                                   vocab_size)
    index = to_device(rows, torch.long, logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed,
                                                                           float("-inf")))


def allowed_from_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32 words -> [rows, vocab] bool (the layout above)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    expanded = (bits.unsqueeze(-1) >> shifts) & 1
    return expanded.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[LogitBias]) -> None:
    """In place: each row's biases added to its tokens (ids past the vocabulary skipped)."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    vocab_size = logits.shape[1]
    for i, bias in enumerate(biases):
        for token_id, value in bias:
            if token_id < vocab_size:
                rows.append(i)
                ids.append(token_id)
                values.append(value)
    if rows:
        device = logits.device
        logits.index_put_((to_device(rows, torch.long, device),
                           to_device(ids, torch.long, device)),
                          to_device(values, logits.dtype, device), accumulate=True)


def _bit(position: int) -> int:
    """The int32 word with bit `position` set."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
