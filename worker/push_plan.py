"""Which KV blocks a prefill worker sends for one request: a pure function.

The block range is kv_transfer/layout.py's `handoff_blocks` (the diagram is there): blocks
[h, n) of the prompt, where the decode side holds the first h already.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.interface import TransferSpec
from kv_transfer.layout import handoff_blocks


def plan_push(request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              num_prefix_blocks_held: int, num_prompt_tokens: int, block_size: int,
              num_layers: int) -> TransferSpec | None:
    """The transfer for one prefilled prompt, or None when the destination holds it all.

    Raises ValueError when either side has fewer blocks than the prompt needs.
    """
    blocks = handoff_blocks(num_prompt_tokens, block_size, num_prefix_blocks_held)
    if len(src_block_ids) < blocks.stop:
        raise ValueError(f"{request_id}: prefill side holds {len(src_block_ids)} blocks, "
                         f"the prompt needs {blocks.stop}")
    if len(dst_block_ids) < blocks.stop:
        raise ValueError(f"{request_id}: destination reserved {len(dst_block_ids)} blocks, "
                         f"the prompt needs {blocks.stop}")
    if not blocks:
        return None
    return TransferSpec(request_id=request_id,
                        src_block_ids=list(src_block_ids[blocks.start:blocks.stop]),
                        dst_block_ids=list(dst_block_ids[blocks.start:blocks.stop]),
                        layer_begin=0, layer_end=num_layers)
