"""What a worker publishes of its engine: the engine's counters as a `WorkerLoad` (the
rates, the step model and the KV send rate are the worker's own, added by worker/runtime.py).
Engine thread only: it reads the scheduler, the KV cache and its host tier.
"""

from __future__ import annotations

from engine.expert_load import ExpertLoadWindow, ExpertParallelLoad
from engine.llm_engine import LLMEngine
from engine.step_shape import QueueShape, queue_shape
from protocol.worker_load import WorkerLoad


def engine_load(engine: LLMEngine, queued: QueueShape | None = None,
                experts: ExpertLoadWindow | ExpertParallelLoad | None = None) -> WorkerLoad:
    """The engine's counters as a WorkerLoad (rates left at zero); engine thread only.
    `queued`: the queue's shape if known (else read from every live request now);
    `experts`: the expert load window's last figures, for a MoE model."""
    if queued is None:
        queued = queue_shape(engine.live_requests())
    tier = engine.kv_cache.host_tier
    return WorkerLoad(num_waiting=engine.num_waiting, num_running=engine.num_running,
                      num_kv_blocks_used=engine.kv_cache.num_used_blocks,
                      num_kv_blocks_total=engine.kv_cache.num_blocks,
                      num_held_tables=engine.kv_cache.num_tables,
                      num_steps=engine.num_steps,
                      num_queued_prefill_tokens=queued.prefill_tokens,
                      num_decoding=queued.decode_seqs, num_context_tokens=queued.context_tokens,
                      moe_imbalance=experts.imbalance if experts else [],
                      moe_hottest=experts.hottest if experts else [],
                      moe_rank_imbalance=experts.rank_imbalance if experts else [],
                      num_expert_rebalances=experts.num_rebalances if experts else 0,
                      last_switch_imbalance=experts.last_switch[0] if experts else 0.0,
                      last_switch_planned=experts.last_switch[1] if experts else 0.0,
                      num_host_blocks_used=tier.num_held_blocks if tier is not None else 0,
                      num_host_blocks_total=tier.num_host_blocks if tier is not None else 0,
                      host_reload_bytes_per_s=tier.reload_bytes_per_s if tier is not None
                      else 0.0)
