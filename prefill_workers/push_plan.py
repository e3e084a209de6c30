"""Which KV blocks a prefill worker sends for one request: a pure function.

    prompt positions   [0 ........................................ P)
    blocks (size B)    | 0 | 1 | ... | h-1 | h | ... | n-1 |          n = ceil(P / B)
                        held by the decode side   sent: src[h:n] -> dst[h:n]
                        (num_prefix_blocks_held)

The decode side's reservation has one more position (P) for the token sampled here; its
KV is computed there by the first decode step, so it is not part of the push. The last
prompt block may be partial: it travels whole (the slots past P are never read).
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.interface import TransferSpec


def plan_push(request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              num_prefix_blocks_held: int, num_prompt_tokens: int, block_size: int,
              num_layers: int) -> TransferSpec | None:
    """The transfer for one prefilled prompt, or None when the destination holds it all.

    Raises ValueError when either side has fewer blocks than the prompt needs.
    """
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    if len(src_block_ids) < num_prompt_blocks:
        raise ValueError(f"{request_id}: prefill side holds {len(src_block_ids)} blocks, "
                         f"the prompt needs {num_prompt_blocks}")
    if len(dst_block_ids) < num_prompt_blocks:
        raise ValueError(f"{request_id}: destination reserved {len(dst_block_ids)} blocks, "
                         f"the prompt needs {num_prompt_blocks}")
    held = min(num_prefix_blocks_held, num_prompt_blocks)
    if held == num_prompt_blocks:
        return None
    return TransferSpec(request_id=request_id,
                        src_block_ids=list(src_block_ids[held:num_prompt_blocks]),
                        dst_block_ids=list(dst_block_ids[held:num_prompt_blocks]),
                        layer_begin=0, layer_end=num_layers)
