"""The tensor-parallel process group: N processes on one host, each holding 1/N of every layer.

Which slice each rank holds is engine/tensor_parallel_sharding.py's; this module spawns the
ranks, connects them, loads each rank's shard, and runs the steps. Rank 0 drives; the other
ranks follow:

    rank 0:  schedule -> broadcast(StepMessage) -> execute -> sample -> postprocess
    rank k:               receive(StepMessage)  -> execute (logits discarded)
    the first message carries the KV layout; a message without a schedule ends the followers

Expert parallelism (`expert_parallel`) uses the same processes differently: rank 0 runs the
whole model but the other ranks' experts, and the other ranks serve its MoE blocks
(engine/expert_exchange.py) with no schedule, no attention and no KV pool.

Messages are msgspec-encoded bytes (engine/byte_broadcast.py), never pickles.

Lifecycle of a follower: spawned -> connected (process group up) -> weights loaded and
sharded -> KV layout received, pool allocated (tensor parallel only) -> following steps (or
serving expert blocks) -> shutdown message -> exit;
at any point, rank 0 gone (killed, crashed) -> exit within half a second (`exit_with_leader`).
Invariants: every rank executes the same schedules in the same order; only rank 0 samples,
so sampling state (seeds, penalties) lives in one process.

On CPU the group uses gloo; on CUDA nccl, with NCCL_NVLS_ENABLE=0 in every rank's
environment (NVLink multicast is not available on the machines this runs on). TP > 1 runs
the torch path of the model (no Triton kernels, no CUDA graphs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from engine.byte_broadcast import ByteBroadcast
from engine.expert_exchange import ExpertExchange, serve_expert_rank
from engine.expert_parallel import (REBALANCE_INTERVAL_STEPS, ExpertBank, ExpertParallelRank,
                                    ExpertRebalancer, initial_placements, moe_blocks)
from engine.kv_storage import KVLayout, KVStorage
from engine.schedule_output import ScheduleOutput
from engine.tensor_parallel_sharding import check_shardable, shard_config, shard_tensor

if TYPE_CHECKING:  # the model is imported where it is used: a follower's start stays light
    from engine.model_runner import DeviceTokens, ModelRunner
    from engine.models.decoder import DecoderForCausalLM

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 600.0
# A follower's collectives wait for rank 0's next step for as long as the worker idles: a
# bound would end an idle worker's followers (and with them its next step). Rank 0 gone
# ends a follower at once (`exit_with_leader`); a hung rank 0 is a hung worker, which the
# operations agent restarts. (Rank 0 keeps `timeout_s` for its waits inside a step.)
FOLLOWER_WAIT_S = 30 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This process's place in the group. `device` is where collectives' tensors live
    (CPU for gloo, this rank's GPU for nccl)."""

    tp_rank: int
    tp_size: int
    device: torch.device
    expert_parallel: bool = False  # rank 0 the model, the others experts (expert_exchange)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        dist.all_reduce(x)
        return x


def shard_model(full: "DecoderForCausalLM", group: TensorParallelGroup,
                device: torch.device | str) -> "DecoderForCausalLM":
    """This rank's model: built from shard_config, filled from the full model's state dict,
    its decoder layers wired to all-reduce; with expert parallelism (rank 0 only), the whole
    model but the experts other ranks hold, its MoE blocks wired to the expert ranks. The
    caller drops `full` afterwards."""
    dtype = full.model.embed_tokens.weight.dtype
    ep = group.expert_parallel
    if ep and group.tp_rank != 0:
        raise ValueError("an expert rank holds experts only (engine/expert_exchange.py)")
    model = type(full)(shard_config(full.config, group.tp_size, ep), dtype=dtype, device=device)
    if ep:  # this rank's experts only; the others' weights stay in the host bank
        model.expert_parallel = ExpertParallelRank(0, ExpertBank.of(full), device)
        model.expert_parallel.place(model, initial_placements(model, group.tp_size))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in full.state_dict().items():
            if params[name].numel():  # (an expert this rank does not hold is empty)
                params[name].copy_(tensor if ep else
                                   shard_tensor(name, tensor, group.tp_rank, group.tp_size))
    if ep:
        model.enable_expert_parallel(group.tp_size,
                                     ExpertExchange(moe_blocks(model), group.device))
    else:
        model.enable_tensor_parallel(group.tp_size, group.all_reduce)
    return model.eval()


class StepMessage(msgspec.Struct, frozen=True):
    """Rank 0 -> tensor-parallel followers, once per step. No schedule: shut down."""

    schedule: ScheduleOutput | None


class DrivingRunner:
    """Rank 0's runner: sends each schedule to the followers, then runs its own shard.
    Constructing it sends the KV layout (followers allocate their pool from it). With expert
    parallelism it only plans and sends expert placements: its model's MoE blocks call the
    expert ranks themselves (engine/expert_exchange.py)."""

    def __init__(self, runner: "ModelRunner", group: TensorParallelGroup,
                 rebalance_every: int = REBALANCE_INTERVAL_STEPS) -> None:
        if group.tp_rank != 0:
            raise ValueError(f"only rank 0 drives; this is rank {group.tp_rank}")
        self.runner = runner
        self.expert_rank: ExpertParallelRank | None = getattr(runner.model, "expert_parallel",
                                                               None)
        self.rebalancer = (None if self.expert_rank is None
                           else ExpertRebalancer(runner.model, group.tp_size, rebalance_every))
        blocks = moe_blocks(runner.model)
        exchange = blocks[0].exchange if blocks else None
        self.exchange = exchange if isinstance(exchange, ExpertExchange) else None
        self._channel = ByteBroadcast(group.device)
        self._closed = False
        if self.exchange is None:
            self._channel.send(msgspec.msgpack.encode(runner.kv.layout))

    @property
    def records_layer_events(self) -> bool:
        return False  # the followers' layers finish on their own devices

    @property
    def reads_device_tokens(self) -> bool:
        return False  # the followers receive whole schedules: every token on the host

    def execute(self, schedule: ScheduleOutput,
                on_layer: Callable[[int], None] | None = None,
                previous: DeviceTokens | None = None) -> torch.Tensor:
        if on_layer is not None:
            raise ValueError("a tensor-parallel group records no layer events")
        if previous is not None:
            raise ValueError("a tensor-parallel group runs no overlapped steps")
        if self._closed:
            raise RuntimeError("the tensor-parallel group has been shut down")
        if self.exchange is None:
            self._channel.send(msgspec.msgpack.encode(StepMessage(schedule)))
            return self.runner.execute(schedule)
        placements = None if self.rebalancer is None else self.rebalancer.step()
        if placements is not None and self.expert_rank is not None:
            self.exchange.send_placements(placements)  # every rank switches before the step
            self.expert_rank.place(self.runner.model, placements)
        return self.runner.execute(schedule)

    def close(self) -> None:
        """Tell the followers to exit; idempotent."""
        if not self._closed:
            self._closed = True
            if self.exchange is not None:
                self.exchange.stop()
            else:
                self._channel.send(msgspec.msgpack.encode(StepMessage(None)))


def follow(model: "DecoderForCausalLM", group: TensorParallelGroup,
           device: torch.device | str) -> int:
    """A tensor-parallel follower's loop: receive the KV layout, then execute each step until
    told to stop. Returns the number of steps executed."""
    from engine.model_runner import ModelRunner

    channel = ByteBroadcast(group.device)
    layout = msgspec.msgpack.decode(channel.receive(), type=KVLayout)
    runner = ModelRunner(model, KVStorage(layout, device), layout.block_size,
                         use_kernels=False, cuda_graph_batch_sizes=())
    decoder = msgspec.msgpack.Decoder(StepMessage)
    num_steps = 0
    while (message := decoder.decode(channel.receive())).schedule is not None:
        runner.execute(message.schedule)
        num_steps += 1
    return num_steps


def rank_device(device: str, tp_rank: int) -> torch.device:
    """Rank r's device: `cuda:i` -> `cuda:i+r` (one GPU per rank); CPU is shared."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + tp_rank)


def connect(tp_rank: int, tp_size: int, store: dist.Store, device: torch.device,
            timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False
            ) -> TensorParallelGroup:
    """Join the default process group (gloo on CPU, nccl on CUDA). `timeout_s` bounds every
    collective of this rank (a follower passes FOLLOWER_WAIT_S)."""
    if device.type == "cuda":
        # NVLink multicast (NVLS) is unavailable on the target machines; NCCL must not try it.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=tp_rank, world_size=tp_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(tp_rank, tp_size, device, expert_parallel)


class Followers:
    """Ranks 1..N-1 as child processes of rank 0, and the store they rendezvous through.
    Rank 0 owns them: `stop()` waits for them to exit (after DrivingRunner.close) and kills
    any that do not."""

    def __init__(self, tp_size: int, model: str, dtype: str, device: str,
                 threads: int | None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 expert_parallel: bool = False) -> None:
        # Port 0: the store binds a free port and the children learn it from their argv.
        self.store = dist.TCPStore(HOST, 0, tp_size, True,
                                   timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        env = dict(os.environ)
        if torch.device(device).type == "cuda":
            env["NCCL_NVLS_ENABLE"] = "0"
        self.processes: list[subprocess.Popen] = []
        for rank in range(1, tp_size):
            argv = [sys.executable, "-m", "engine.tensor_parallel_group", "--rank", str(rank),
                    "--tp", str(tp_size), "--port", str(self.store.port), "--model", model,
                    "--dtype", dtype, "--device", device, "--timeout-s", str(timeout_s),
                    "--leader-pid", str(os.getpid())]
            if threads is not None:
                argv += ["--threads", str(threads)]
            if expert_parallel:
                argv.append("--ep")
            # Followers print nothing a user asked for: their stdout joins rank 0's stderr.
            self.processes.append(subprocess.Popen(argv, env=env, stdout=sys.stderr))

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """Wait for every follower; kill those still running after `timeout_s`. Their exit
        codes, in rank order."""
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=timeout_s) if timeout_s > 0
                             else _kill_if_running(process))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes


def _kill_if_running(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.kill()
    return process.wait()


def load_shard(model: str, group: TensorParallelGroup, dtype: torch.dtype,
               device: torch.device | str):
    """Load the whole checkpoint on the CPU, keep this rank's shard on `device`. Returns
    (LoadedModel of the full model without its weights, sharded model)."""
    from engine.loader import load_model

    loaded = load_model(model, dtype=dtype, device="cpu")
    check_shardable(loaded.config, group.tp_size, group.expert_parallel)
    sharded = shard_model(loaded.model, group, device)
    return dataclasses.replace(loaded, model=sharded)


def exit_with_leader(leader_pid: int, period_s: float = 0.5) -> None:
    """A follower's watch on rank 0, its parent: once the parent is gone (killed, crashed),
    end this process. Without it a follower would wait in a collective (FOLLOWER_WAIT_S),
    or for the store, holding its share of the weights and KV (on a GPU, the GPU's memory)
    while the restarted worker spawns new ranks. Runs as the follower's one daemon thread;
    the process ends with it."""
    while os.getppid() == leader_pid:  # an orphan is adopted by another process
        time.sleep(period_s)
    os._exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    """A follower rank:
    `python -m engine.tensor_parallel_group --rank R --tp N --port P ...`."""
    parser = argparse.ArgumentParser(prog="engine.tensor_parallel_group")
    parser.add_argument("--rank", type=int, required=True, help="this follower's rank (>= 1)")
    parser.add_argument("--tp", type=int, required=True, help="the tensor-parallel degree")
    parser.add_argument("--port", type=int, required=True, help="the leader's rendezvous port")
    parser.add_argument("--model", required=True, help="the leader's model path")
    parser.add_argument("--dtype", default="float32", help="weights' dtype (default float32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--ep", action="store_true", help="whole experts per rank")
    parser.add_argument("--leader-pid", type=int, default=0,
                        help="rank 0's pid: this process ends when rank 0 is gone (default: "
                             "the parent's pid at start)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                        help="limit on the rendezvous with the leader (default %(default)s); "
                             "the steps that follow are waited for as long as the leader "
                             "lives")
    args = parser.parse_args(argv)
    threading.Thread(target=exit_with_leader, args=(args.leader_pid or os.getppid(),),
                     daemon=True, name="leader-watch").start()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = rank_device(args.device, args.rank)
    store = dist.TCPStore(HOST, args.port, args.tp, False,
                          timeout=datetime.timedelta(seconds=args.timeout_s))
    group = connect(args.rank, args.tp, store, device, FOLLOWER_WAIT_S, args.ep)
    dtype = getattr(torch, args.dtype)
    try:
        if args.ep:
            serve_expert_rank(args.model, args.rank, args.tp, dtype, device)
        else:
            follow(load_shard(args.model, group, dtype, device).model, group, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The group is destroyed and every result delivered; skip interpreter finalization,
    # where gloo's worker threads can still be torn down and abort the process (SIGABRT,
    # "terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
