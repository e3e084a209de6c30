"""Layer-wise KV copies queued behind the engine's per-layer events (CUDA only).

The model runner records one event per layer while a long prompt's step is queued
(engine/kv_ready.py); mapped_copy.copy_after queues each layer's copy into another pool
behind its event, before the step has run. The copied blocks must equal the source's
bitwise once the step and the copies completed. A GPU sleep on the step's stream right
after layer 0 holds every layer's event back, so every copy is queued before any of them
completed: a copy that did not wait for its layer's event would run at once and carry the
pool's old contents for layers 1.. (the poison). That `execute` returns with the sleep
still running also checks that nothing in it waits for the layers it queued.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_ready import LayerEventRecorder
from engine.kv_storage import KVStorage
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from kv_transfer.interface import TransferSpec
from kv_transfer.mapped_copy import CopyContext, MappedCopy

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK_SIZE = 16
POISON = 7.0


def test_copies_behind_layer_events_carry_exactly_what_the_step_wrote() -> None:
    torch.manual_seed(0)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=1024,
                         intermediate_size=2816, num_layers=8, num_heads=8, num_kv_heads=8,
                         head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=torch.device("cuda"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    num_tokens = 4000
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    src = KVStorage.for_model(config, 2 * num_blocks, BLOCK_SIZE, torch.bfloat16, "cuda")
    dst = KVStorage.for_model(config, 2 * num_blocks, BLOCK_SIZE, torch.bfloat16, "cuda")
    runner = ModelRunner(model.eval(), src, BLOCK_SIZE, cuda_graph_batch_sizes=())
    src.kv.fill_(POISON)
    dst.kv.fill_(-POISON)
    src_ids = list(range(num_blocks - 1, -1, -1))  # reversed: no run is contiguous by luck
    dst_ids = [num_blocks + 7 * i % num_blocks for i in range(num_blocks)]  # 7 and 250: coprime
    assert len(set(dst_ids)) == num_blocks
    spec = TransferSpec(request_id="r", src_block_ids=src_ids, dst_block_ids=dst_ids,
                        layer_begin=0, layer_end=config.num_layers)
    prompt = tuple(int(t) for t in torch.randint(0, config.vocab_size, (num_tokens,)))
    schedule = ScheduleOutput((ScheduledChunk("r", prompt, 0, tuple(src_ids), True),))

    runner.execute(schedule)  # compiles every kernel: the timed run below only queues
    src.kv.fill_(POISON)

    async def run() -> None:
        context = CopyContext(torch.device("cuda"), None)
        recorder = LayerEventRecorder()

        def on_layer(layer: int) -> None:
            if layer == 0:  # ~0.1 s of GPU time between layer 0 and its event
                torch.cuda._sleep(200_000_000)
            recorder(layer)

        torch.cuda.synchronize()
        runner.execute(schedule, on_layer)  # queued, not waited for (nothing syncs after)
        assert len(recorder.events) == config.num_layers
        # As in the worker: the transfer (its block ids uploaded) is made mid-step. Making
        # it must not wait for the busy default stream.
        started = time.perf_counter()
        copy = MappedCopy(spec, src.kv, dst.kv, context)
        assert time.perf_counter() - started < 0.05
        assert not recorder.events[0].query()  # no layer has run yet
        await copy.copy_after(spec.layers, recorder.events)

    asyncio.run(run())
    torch.cuda.synchronize()
    got = dst.kv[:, :, dst_ids]
    want = src.kv[:, :, src_ids]
    full = want[:, :, :num_tokens // BLOCK_SIZE]  # the prompt's full blocks, in order
    assert not bool((full == POISON).all(dim=-1).any())  # the step wrote every slot
    assert torch.equal(got, want)
