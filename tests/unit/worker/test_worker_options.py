"""Worker options: the warm-up and pipelined-steps choices (auto: by device) and bad
values refused."""

from __future__ import annotations

import pytest

from engine.step_mode import StepMode
from launcher.cli import build_parser, main
from protocol.messages import Role


def options(*extra: str, kind: str = "decode"):
    """The options of `pdserve KIND-worker ...`."""
    from worker.options import options_from_args

    args = build_parser().parse_args([f"{kind}-worker", "--redis-url", "redis://x:1/0", *extra])
    return options_from_args(args)


@pytest.mark.parametrize("extra, warms", [
    ((), False), (("--device", "cuda"), True), (("--device", "cuda:1"), True),
    (("--device", "cuda", "--warm-up", "off"), False), (("--warm-up", "on"), True)])
def test_the_warm_up_runs_on_cuda_unless_told(extra, warms) -> None:
    assert options(*extra).warms_up is warms


@pytest.mark.parametrize("extra, mode", [
    ((), StepMode.PLAIN), (("--device", "cuda"), StepMode.OVERLAPPED),
    (("--device", "cuda", "--pipelined-steps", "on"), StepMode.PIPELINED),
    (("--device", "cuda", "--pipelined-steps", "off"), StepMode.PLAIN),
    (("--pipelined-steps", "on"), StepMode.PIPELINED),
    (("--device", "cuda", "--pipelined-steps", "overlap"), StepMode.OVERLAPPED),
    (("--pipelined-steps", "overlap"), StepMode.OVERLAPPED)])
def test_steps_are_pipelined_on_cuda_unless_told(extra, mode) -> None:
    assert options(*extra).step_mode is mode


@pytest.mark.parametrize("extra, seats", [
    ((), 64), (("--device", "cuda"), 256), (("--device", "cuda:1"), 256),
    (("--device", "cuda", "--max-num-seqs", "32"), 32), (("--max-num-seqs", "100"), 100)])
def test_the_batch_holds_more_requests_on_cuda_unless_told(extra, seats) -> None:
    assert options(*extra).max_num_seqs == seats


def test_a_negative_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-num-seqs"):
        options("--max-num-seqs", "-1")


def test_a_prefill_worker_overlaps_its_steps_on_cuda_unless_told() -> None:
    assert options("--device", "cuda", kind="prefill").step_mode is StepMode.OVERLAPPED
    assert options("--device", "cuda", "--pipelined-steps", "on",
                   kind="prefill").step_mode is StepMode.PIPELINED
    assert options(kind="prefill").step_mode is StepMode.PLAIN


def test_choices_come_from_the_environment_too() -> None:
    import argparse

    from worker.options import add_worker_options

    parser = argparse.ArgumentParser()
    add_worker_options(parser, Role.DECODE, env={"PDSERVE_PIPELINED_STEPS": "off"})
    assert parser.parse_args([]).pipelined_steps == "off"


@pytest.mark.parametrize("option", ["--warm-up", "--pipelined-steps", "--kv-mapping"])
def test_an_unknown_auto_on_off_choice_is_a_usage_error(option, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["decode-worker", "--redis-url", "redis://x:1/0", option, "maybe"])
    assert exit_info.value.code == 2 and option in capsys.readouterr().err


def test_the_gil_switch_interval_is_an_option_with_bounds() -> None:
    assert options().gil_switch_ms == 0.5
    assert options("--gil-switch-ms", "5").gil_switch_ms == 5.0
    with pytest.raises(ValueError, match="--gil-switch-ms"):
        options("--gil-switch-ms", "0")


def test_each_subcommand_starts_in_its_role_unless_role_says_else() -> None:
    assert options(kind="prefill").role is Role.PREFILL
    assert options().role is Role.DECODE
    assert options("--role", "both").role is Role.BOTH
    assert options("--role", "decode", kind="prefill").role is Role.DECODE


def test_the_prefill_lane_is_off_auto_shared_or_a_number_of_sms() -> None:
    from worker.options import lane_is_shared, parse_lane_option

    assert options().prefill_lane == "off" and parse_lane_option("off") == 0
    assert parse_lane_option("auto") is None and not lane_is_shared("auto")
    assert options("--prefill-lane", "shared").prefill_lane == "shared"
    assert parse_lane_option("shared") is None and lane_is_shared("shared")
    assert not lane_is_shared("66") and not lane_is_shared("off")
    assert options("--prefill-lane", "66").prefill_lane == "66" and parse_lane_option("66") == 66
    for bad in ("0", "-4", "half", ""):
        with pytest.raises(ValueError, match="--prefill-lane"):
            options("--prefill-lane", bad)


def test_the_gpu_memory_fraction_is_a_share_in_bounds() -> None:
    assert options().gpu_memory_fraction == 0.0
    assert options("--gpu-memory-fraction", "0.45").gpu_memory_fraction == 0.45
    with pytest.raises(ValueError, match="--gpu-memory-fraction"):
        options("--gpu-memory-fraction", "1.5")


def test_the_kv_cache_dtype_is_the_models_unless_told() -> None:
    import torch

    from worker.options import kv_cache_dtype

    assert options().kv_cache_dtype == "auto" and kv_cache_dtype("auto") is None
    assert options("--kv-cache-dtype", "fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    assert kv_cache_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert kv_cache_dtype("bf16") == torch.bfloat16
    with pytest.raises(SystemExit):
        options("--kv-cache-dtype", "int4")


def test_tensor_parallel_groups_run_colocated_and_expert_parallel_ones_in_any_role() -> None:
    group = options("--role", "colocated", "--ep", "2")
    assert (group.tp_size, group.ep, group.expert_rebalance_steps) == (2, 2, 64)
    assert options("--role", "colocated", "--tp", "3").tp_size == 3
    # An expert-parallel group keeps its KV pool whole on rank 0: it hands KV off and
    # receives it as one process does, and may keep a host tier.
    assert options("--ep", "2").tp_size == 2  # (a decode worker)
    assert options("--role", "prefill", "--ep", "4", "--kv-host-cache-gb", "1").tp_size == 4
    with pytest.raises(ValueError, match="needs --role colocated"):
        options("--tp", "2")  # a decode worker receives KV into one process's pool
    with pytest.raises(ValueError, match="does not combine with --tp 3: give --tp 2"):
        options("--role", "colocated", "--ep", "2", "--tp", "3")
    # --tp equal to --ep names the same processes: an expert-parallel group, any role.
    same = options("--role", "decode", "--ep", "2", "--tp", "2")
    assert (same.tp_size, same.ep) == (2, 2)
    with pytest.raises(ValueError, match="does not support --kv-host-cache-gb"):
        options("--role", "colocated", "--tp", "2", "--kv-host-cache-gb", "1")
    with pytest.raises(ValueError, match="does not support --prefill-lane"):
        options("--ep", "2", "--prefill-lane", "auto")
    with pytest.raises(ValueError, match="at least 1"):
        options("--role", "colocated", "--ep", "0")
