"""Expert parallelism on CPU (`--ep 2`): a real expert rank over gloo holding whole experts
while this process, rank 0, runs the rest of the model; the reference is the unsharded model
in this process.

A skewed checkpoint (one expert picked by every token: its router row reads a component
every token's hidden state carries) makes its home rank the busiest; the rebalancer gives
that expert a second copy, the imbalance falls, and the tokens stay the unsharded ones
through the switch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import (BLOCK_SIZE, BLOCKS_PER_SEQ, PROMPTS, _greedy_batch, driving_pair,
                                  run_group)

from engine.expert_parallel import ExpertRebalancer, moe_blocks
from engine.kv_storage import KVStorage
from engine.loader import load_model
from engine.model_runner import ModelRunner
from testing.skewed_experts import skew_experts


def _run_ep(path: Path, rebalance_every: int) -> tuple[list[list[int]], torch.Tensor,
                                                       ExpertRebalancer, torch.nn.Module]:
    tokens, logits, runner = run_group(path, 2, expert_parallel=True,
                                       rebalance_every=rebalance_every)
    assert runner.rebalancer is not None
    return tokens, logits, runner.rebalancer, runner.runner.model


def _reference(path: Path) -> tuple[list[list[int]], torch.Tensor]:
    full = load_model(str(path)).model
    kv = KVStorage.for_model(full.config, len(PROMPTS) * BLOCKS_PER_SEQ, BLOCK_SIZE,
                             torch.float32)
    return _greedy_batch(ModelRunner(full, kv, BLOCK_SIZE))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_whole_experts_per_rank_give_the_unsharded_tokens(variant, tiny_model, single_thread):
    path = tiny_model(variant).path
    expected_tokens, expected_logits = _reference(path)
    tokens, logits, _, shard = _run_ep(path, rebalance_every=1000)
    assert tokens == expected_tokens
    rel_err = (logits - expected_logits).norm() / expected_logits.norm()
    assert rel_err < 1e-4, f"relative error {rel_err:.2e}"
    for block in moe_blocks(shard):  # rank 0 holds experts 0 and 1, whole; 2 and 3 not at all
        held = [e for e, x in enumerate(block.experts) if x.gate_proj.weight.numel()]
        assert held == [0, 1] and block.shares == {0: (0, 1), 1: (0, 1)}
        assert block.experts[0].gate_proj.weight.shape[0] == shard.config.moe.intermediate_size
    # Attention and the KV cache are whole on rank 0: its pool is a single process's, which
    # a KV handoff moves to a worker of any expert-parallel size.
    full = load_model(str(path)).model.config
    assert (shard.config.num_heads, shard.config.num_kv_heads) == (full.num_heads,
                                                                   full.num_kv_heads)


@pytest.mark.timeout(120)
def test_a_hot_expert_gets_a_second_copy_and_the_tokens_do_not_change(tiny_model, tmp_path,
                                                                     single_thread):
    path = skew_experts(tiny_model("qwen3_moe").path, tmp_path / "skewed", {0: 3.0})
    expected_tokens, expected_logits = _reference(path)
    tokens, logits, rebalancer, shard = _run_ep(path, rebalance_every=2)
    assert tokens == expected_tokens  # through the switch: nothing lost, nothing changed
    first = rebalancer.rebalances[0]
    # Expert 0, which every token picks in the first MoE layer, has a copy on each rank; each
    # layer copied its hottest expert (the second layer's mix is its own).
    assert rebalancer.placements[0].replicas[0] == (0, 1), rebalancer.placements
    assert all(sorted(map(len, p.replicas)) == [1, 1, 1, 2] for p in rebalancer.placements)
    # In the first MoE layer rank 0 (experts 0 and 1) took 70% of the assignments (busiest
    # over mean 1.4 here); after the switch the ranks share them nearly evenly (1.1).
    assert first.imbalance_before[0] > 1.25 and first.imbalance_after[0] < 0.85 * 1.4, first
    assert all(r.imbalance_after[i] < r.imbalance_before[i] for r in rebalancer.rebalances
               for i in range(2) if r.imbalance_after[i] != r.imbalance_before[i])
    assert rebalancer.imbalance[0] < first.imbalance_before[0]  # the last window, balanced
    assert moe_blocks(shard)[0].shares[0] == (0, 2)  # rank 0: every other row of expert 0


def test_generate_cli_refuses_ep_on_a_dense_model_and_beside_tp() -> None:
    import subprocess
    import sys

    run = [sys.executable, "-m", "launcher.cli", "generate", "hello", "--ep", "3"]
    dense = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert dense.returncode == 2 and "mixture-of-experts" in dense.stderr
    # Said first, before the head count 2 does not divide (the user asked for --ep).
    dense = subprocess.run(run[:-1] + ["2"], capture_output=True, text=True, timeout=120)
    assert dense.returncode == 2 and "(--ep) needs a mixture-of-experts" in dense.stderr
    mixed = subprocess.run(run + ["--tp", "2"], capture_output=True, text=True, timeout=120)
    assert mixed.returncode == 2 and "does not combine with --tp 2: give --tp 3" in mixed.stderr



@pytest.mark.timeout(120)
def test_a_killed_expert_rank_fails_rank_0s_next_step_at_once(tiny_model, single_thread):
    """No step waits out the group's timeout for an expert rank that is gone: rank 0's next
    exchange fails, so the worker ends and its requests move on."""
    import time

    with driving_pair(str(tiny_model("qwen3_moe").path), 60.0, True) as (followers, runner,
                                                                          step):
        assert runner.execute(step).shape[0] == 1  # the group works
        followers.processes[0].kill()
        followers.processes[0].wait()
        started = time.monotonic()
        with pytest.raises(RuntimeError):  # gloo's error for a closed peer (DistBackendError)
            runner.execute(step)
        assert time.monotonic() - started < 10
