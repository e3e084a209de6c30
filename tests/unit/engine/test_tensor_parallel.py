"""Tensor parallelism on CPU: real follower processes over gloo on 127.0.0.1.

This test process is rank 0 (it drives, exactly as `pdserve generate --tp N` does); the
followers are spawned by `Followers`, rendezvous through a store bound to port 0, load the
same checkpoint and keep their shard. The reference is the unsharded model in this process.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.expert_parallel import REBALANCE_INTERVAL_STEPS
from engine.kv_storage import KVStorage
from engine.loader import load_model, read_model_config
from engine.model_runner import ModelRunner
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from engine.tensor_parallel_group import DrivingRunner, Followers, connect, load_shard
from engine.tensor_parallel_sharding import (ShardDim, check_shardable, shard_config, shard_dim,
                                             shard_tensor)

PROMPTS = ([5, 17, 42, 99, 3, 250, 7], [11, 12], [300, 1, 64, 128, 9, 9, 9, 31, 77, 4, 200])
NUM_TOKENS = 6
BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8


def _greedy_batch(runner) -> tuple[list[list[int]], torch.Tensor]:
    """All prompts prefilled in one step, then decoded together: (tokens, prefill logits)."""
    tables = [tuple(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
              for i in range(len(PROMPTS))]
    seqs = [list(p) for p in PROMPTS]
    logits = runner.execute(ScheduleOutput(tuple(
        ScheduledChunk(f"r{i}", tuple(p), 0, tables[i], True) for i, p in enumerate(PROMPTS))))
    first_logits = logits.clone()
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(NUM_TOKENS):
        for i, row in enumerate(logits):
            outputs[i].append(int(row.argmax()))
            seqs[i].append(outputs[i][-1])
        if step + 1 < NUM_TOKENS:
            logits = runner.execute(ScheduleOutput(tuple(
                ScheduledChunk(f"r{i}", (s[-1],), len(s) - 1, tables[i], True)
                for i, s in enumerate(seqs))))
    return outputs, first_logits


def _write_kv3_model(directory: Path) -> Path:
    """Six heads over three KV heads: a shape only TP 1 and 3 can split (like the default
    model's 9/3), small enough for three processes on a shared machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=96, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                         head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                         initializer_range=0.25, tie_word_embeddings=True)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant,tp_size", [("qwen2_bias", 2), ("llama_untied", 2),
                                             ("qwen3", 2), ("gemma2", 2), ("kv3", 3),
                                             ("qwen3_moe_sparse_step", 2), ("mixtral", 2)])
def test_sharded_greedy_matches_unsharded(variant, tp_size, tmp_path, tiny_model,
                                          single_thread):
    path = _write_kv3_model(tmp_path) if variant == "kv3" else tiny_model(variant).path
    full = load_model(str(path)).model
    reference_kv = KVStorage.for_model(full.config, len(PROMPTS) * BLOCKS_PER_SEQ,
                                       BLOCK_SIZE, torch.float32)
    expected_tokens, expected_logits = _greedy_batch(ModelRunner(full, reference_kv, BLOCK_SIZE))

    tokens, logits, runner = run_group(path, tp_size)
    assert runner.runner.model.config.num_kv_heads == full.config.num_kv_heads // tp_size
    assert tokens == expected_tokens
    rel_err = (logits - expected_logits).norm() / expected_logits.norm()
    assert rel_err < 1e-4, f"relative error {rel_err:.2e}"
    # Each rank's pool holds only its own KV heads.
    assert runner.runner.kv.kv.shape[4] == reference_kv.kv.shape[4] // tp_size


def run_group(path: Path, tp_size: int, expert_parallel: bool = False,
              rebalance_every: int = REBALANCE_INTERVAL_STEPS
              ) -> tuple[list[list[int]], torch.Tensor, DrivingRunner]:
    """`_greedy_batch` over a group of `tp_size` ranks (this process rank 0, the followers
    spawned, every follower checked to exit 0): (tokens, prefill logits, rank 0's runner)."""
    followers = Followers(tp_size, str(path), "float32", "cpu", threads=1, timeout_s=60.0,
                          expert_parallel=expert_parallel)
    connected = False
    try:
        group = connect(0, tp_size, followers.store, torch.device("cpu"), timeout_s=60.0,
                        expert_parallel=expert_parallel)
        connected = True
        shard = load_shard(str(path), group, torch.float32, "cpu").model
        kv = KVStorage.for_model(shard.config, len(PROMPTS) * BLOCKS_PER_SEQ, BLOCK_SIZE,
                                 torch.float32)
        runner = DrivingRunner(ModelRunner(shard, kv, BLOCK_SIZE), group, rebalance_every)
        tokens, logits = _greedy_batch(runner)
        runner.close()
        codes = followers.stop(timeout_s=30.0)
    finally:
        followers.stop(timeout_s=0.0)
        if connected:
            dist.destroy_process_group()
    assert codes == [0] * (tp_size - 1)
    return tokens, logits, runner


def test_shards_reassemble_the_full_weights(tiny_model):
    full = load_model(str(tiny_model("qwen2_bias").path)).model
    for name, tensor in full.state_dict().items():
        parts = [shard_tensor(name, tensor, rank, 2) for rank in range(2)]
        dim = shard_dim(name)
        if dim is ShardDim.REPLICATED:
            assert all(p is tensor for p in parts), name
        else:
            assert parts[0].shape[dim.value] * 2 == tensor.shape[dim.value], name
            assert torch.equal(torch.cat(parts, dim=dim.value), tensor), name
    assert shard_dim("model.layers.0.self_attn.k_proj.bias") is ShardDim.COLUMN
    assert shard_dim("model.layers.0.mlp.down_proj.weight") is ShardDim.ROW
    assert shard_dim("model.embed_tokens.weight") is ShardDim.REPLICATED
    # Experts shard as dense MLPs do; the router is replicated.
    assert shard_dim("model.layers.0.mlp.experts.3.up_proj.weight") is ShardDim.COLUMN
    assert shard_dim("model.layers.0.mlp.experts.3.down_proj.weight") is ShardDim.ROW
    assert shard_dim("model.layers.0.mlp.gate.weight") is ShardDim.REPLICATED


def test_default_model_refuses_tp2_and_accepts_tp3():
    config = read_model_config("default")
    with pytest.raises(ValueError, match=r"size 2 .* 3 KV heads \(9 attention heads\)"):
        check_shardable(config, 2)
    check_shardable(config, 3)
    shard = shard_config(config, 3)
    assert (shard.num_heads, shard.num_kv_heads) == (3, 1)


@pytest.mark.timeout(60)
def test_generate_cli_refuses_tp2_on_the_default_model_before_spawning():
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "generate", "hello", "--tp", "2"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "3 KV heads (9 attention heads)" in result.stderr
    assert "waiting for" not in result.stderr  # no follower was started
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_a_group_wider_than_the_hosts_gpus_is_refused_before_spawning():
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "generate", "hello", "--tp", "3", "--device",
         f"cuda:{torch.cuda.device_count()}"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "(one per rank); this host has" in result.stderr
    assert "waiting for" not in result.stderr


@contextlib.contextmanager
def driving_pair(path: str, follower_timeout_s: float, expert_parallel: bool
                 ) -> Iterator[tuple[Followers, DrivingRunner, ScheduleOutput]]:
    """Rank 0 of a two-process group over the model at `path`, in this process (its
    DrivingRunner), its follower (`follower_timeout_s`: the follower's --timeout-s) and a
    one-prompt step; the group is torn down on leaving, whatever happened."""
    followers = Followers(2, path, "float32", "cpu", threads=1, timeout_s=follower_timeout_s,
                          expert_parallel=expert_parallel)
    try:
        group = connect(0, 2, followers.store, torch.device("cpu"), timeout_s=60.0,
                        expert_parallel=expert_parallel)
        shard = load_shard(path, group, torch.float32, "cpu").model
        kv = KVStorage.for_model(shard.config, BLOCKS_PER_SEQ, BLOCK_SIZE, torch.float32)
        runner = DrivingRunner(ModelRunner(shard, kv, BLOCK_SIZE), group)
        step = ScheduleOutput((ScheduledChunk("r0", tuple(PROMPTS[0]), 0,
                                              tuple(range(BLOCKS_PER_SEQ)), True),))
        yield followers, runner, step
    finally:
        followers.stop(timeout_s=0.0)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_a_group_idle_past_its_rendezvous_timeout_still_steps(tiny_model, single_thread,
                                                             expert_parallel):
    """A worker may idle for hours: its followers wait for the next step as long as rank 0
    lives. (They waited at most --timeout-s, then exited, and the next step failed.)"""
    with driving_pair(str(tiny_model("qwen3_moe").path), 2.0, expert_parallel) as (
            followers, runner, step):
        first = runner.execute(step).clone()
        time.sleep(3.0)  # idle past the followers' 2 s
        assert torch.equal(runner.execute(step), first)
        assert followers.processes[0].poll() is None
        runner.close()
        assert followers.stop(timeout_s=30.0) == [0]


@pytest.mark.timeout(60)
def test_a_follower_ends_when_its_leader_dies_without_stopping_it():
    # The leader spawns one follower and dies at once (as a SIGKILLed worker would): the
    # follower, waiting for a store that is gone, must not outlive it by the group timeout.
    leader = subprocess.run(
        [sys.executable, "-c",
         "import os\n"
         "from engine.tensor_parallel_group import Followers\n"
         "followers = Followers(2, 'default', 'float32', 'cpu', 1)\n"
         "print(followers.processes[0].pid, flush=True)\n"
         "os._exit(0)\n"], capture_output=True, text=True, timeout=60)
    assert leader.returncode == 0, leader.stderr
    follower = int(leader.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(follower), "the follower outlived its leader"


def _alive(pid: int) -> bool:
    """Running (a zombie, which only waits for a reaper, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_cli_tp3_matches_transformers_on_the_default_model(hf_reference):
    # Three ranks of one head group each, spawned by the CLI; the text must be transformers'
    # greedy answer for the same weights (the --tp 1 CLI is checked the same way in
    # tests/integration/test_engine_default_model.py).
    prompt = "The capital of France is"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "generate", prompt, "--max-tokens", "12",
         "--threads", "1", "--tp", "3"], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr
    expected = hf_reference.greedy(hf_reference.prompt_ids(prompt), 12)
    assert result.stdout == expected.text + "\n"
    assert "tensor parallel: 3 ranks ready" in result.stderr
