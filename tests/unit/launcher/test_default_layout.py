"""What `pdserve up` runs without role options: the layout measured best on the host."""

from __future__ import annotations

from launcher.default_layout import default_roles
from launcher.role_options import worker_roles
from protocol.messages import Role


def test_a_cpu_runs_two_workers_that_take_either_role() -> None:
    assert default_roles(0) == [Role.BOTH, Role.BOTH]


def test_one_gpu_runs_one_colocated_worker() -> None:
    assert default_roles(1) == [Role.COLOCATED]


def test_several_gpus_run_one_prefill_and_one_decode_worker() -> None:
    assert default_roles(4) == [Role.PREFILL, Role.DECODE]
    assert default_roles(2) == [Role.PREFILL, Role.DECODE]


def test_role_options_replace_the_default() -> None:
    default = [Role.BOTH, Role.BOTH]
    assert worker_roles(None, None, False, None, None, default) == default
    assert worker_roles(1, None, False, None, None, default) == [Role.PREFILL, Role.DECODE]
    assert worker_roles(None, None, True, None, None, default) == [Role.COLOCATED] * 2
    assert worker_roles(None, None, False, 1, "decode", default) == [Role.DECODE]
