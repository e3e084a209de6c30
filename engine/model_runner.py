"""Executes one `ScheduleOutput` on the model and returns the logits to sample from.

Contract: `execute` is called once per scheduler step with that step's schedule. Its only
side effect is writing the K/V of the scheduled tokens into their slots of `KVStorage`
(positions [start_pos, end_pos) of each chunk); every other slot is left untouched, so
blocks shared through prefix caching or owned by other requests are never clobbered.
It keeps no state between steps: the schedule carries everything (positions, block tables).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.kv_storage import KVStorage
from engine.models.llama import LlamaForCausalLM
from engine.schedule_output import ScheduleOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVStorage, block_size: int) -> None:
        if kv.layout.block_size != block_size:
            raise ValueError(f"KV storage block size {kv.layout.block_size} != {block_size}")
        if kv.layout.num_layers != model.config.num_layers:
            raise ValueError(f"KV storage has {kv.layout.num_layers} layers, "
                             f"the model {model.config.num_layers}")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = model.model.embed_tokens.weight.device

    def execute(self, schedule: ScheduleOutput) -> torch.Tensor:
        """float32 logits [number of chunks with sample=True, vocab], in chunk order.

        Each row is the distribution after the last token of a sampling chunk. An empty
        schedule, or one without sampling chunks, returns an empty [0, vocab] tensor.
        """
        vocab = self.model.config.vocab_size
        if schedule.is_empty:
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in schedule.chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        attn = AttentionMetadata.from_schedule(schedule, self.block_size, self.device)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv, attn)
            if not sample_rows:
                return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            # Only sampled rows pay for the vocabulary projection (the largest matmul).
            return self.model.compute_logits(hidden[rows])
