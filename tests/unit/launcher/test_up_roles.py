"""Which workers `pdserve up` starts: --prefill/--decode as before, --colocated, and
--roles with --workers (each worker starting in its role); how they are named and run."""

from __future__ import annotations

import pytest

from launcher.cli import main
from launcher.local_cluster import WorkerSpec, worker_argv
from launcher.role_options import parse_sizes_by_role, worker_names, worker_roles
from protocol.messages import Role

P, D, B, C = Role.PREFILL, Role.DECODE, Role.BOTH, Role.COLOCATED


def roles(prefill: int | None = None, decode: int | None = None, colocated: bool = False,
          workers: int | None = None, spec: str | None = None) -> list[Role]:
    return worker_roles(prefill, decode, colocated, workers, spec)


def test_the_default_is_one_prefill_worker_and_one_decode_worker() -> None:
    assert roles() == [P, D]
    assert roles(prefill=2, decode=3) == [P] * 2 + [D] * 3
    assert roles(prefill=0) == [D]


def test_colocated_is_roles_colocated() -> None:
    assert roles(colocated=True) == [C] * 2
    assert roles(colocated=True, workers=3) == [C] * 3
    assert roles(spec="colocated") == roles(colocated=True)


def test_one_role_applies_to_every_worker() -> None:
    assert roles(spec="both") == [B] * 2
    assert roles(spec="both", workers=3) == [B] * 3
    assert roles(spec="decode", workers=1) == [D]


def test_a_list_gives_each_worker_its_role() -> None:
    assert roles(spec="prefill,decode") == [P, D]
    assert roles(spec=" prefill , both,decode ") == [P, B, D]
    assert roles(spec="prefill,prefill,decode", workers=3) == [P, P, D]


def test_a_list_must_match_workers() -> None:
    with pytest.raises(ValueError, match="--roles lists 2 roles but --workers is 3"):
        roles(spec="prefill,decode", workers=3)


def test_unknown_and_empty_roles_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown role 'prefil'.*prefill, decode"):
        roles(spec="prefil,decode")
    with pytest.raises(ValueError, match="empty role"):
        roles(spec="prefill,,decode")


@pytest.mark.parametrize("kwargs", [
    {"spec": "prefill"}, {"spec": "prefill", "workers": 3}, {"decode": 0},
    {"prefill": 2, "decode": 0}])
def test_some_worker_must_decode(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="at least one worker that decodes"):
        roles(**kwargs)


def test_conflicting_options_are_refused() -> None:
    with pytest.raises(ValueError, match="--roles conflicts with --colocated"):
        roles(colocated=True, spec="both")
    with pytest.raises(ValueError, match="--prefill / --decode conflict with --roles"):
        roles(prefill=1, spec="both")
    with pytest.raises(ValueError, match="--prefill / --decode conflict with --colocated"):
        roles(decode=2, colocated=True)
    with pytest.raises(ValueError, match="--workers counts the workers of --roles"):
        roles(workers=3)
    with pytest.raises(ValueError, match="--workers must be at least 1"):
        roles(spec="both", workers=0)
    with pytest.raises(ValueError, match="--decode must be >= 0"):
        roles(decode=-1)


def test_workers_are_named_by_role_and_counted_per_role() -> None:
    assert worker_names(roles()) == ["prefill-0", "decode-0"]
    assert worker_names(roles(spec="prefill,decode,prefill,both")) == [
        "prefill-0", "decode-0", "prefill-1", "both-0"]


def test_workers_run_the_subcommand_of_their_role() -> None:
    base, common = ["python", "-m", "launcher.cli"], ["--model", "m"]
    argv = worker_argv(WorkerSpec(Role.BOTH, "cpu", "both-0-abc"), base, common)
    assert argv == [*base, "decode-worker", "--model", "m", "--device", "cpu",
                    "--worker-id", "both-0-abc", "--role", "both"]
    for role in roles(spec="prefill,decode")[0], roles()[0]:  # prefill-worker, as before
        argv = worker_argv(WorkerSpec(role, "cpu", "prefill-0-abc"), base, common)
        assert argv[3] == "prefill-worker" and "--role" not in argv


def test_cpu_kv_cache_is_a_share_of_available_memory_within_bounds():
    from launcher.memory_defaults import cpu_kv_cache_mb

    # 15% of 24 GiB over 2 workers = 1843 MiB each; bounded to 256..4096; unknown: 256.
    assert cpu_kv_cache_mb(2, 24 << 30) == 1843
    assert cpu_kv_cache_mb(1, 64 << 30) == 4096
    assert cpu_kv_cache_mb(4, 2 << 30) == 256
    assert cpu_kv_cache_mb(2, None) == 256


def test_up_refuses_zero_gateways_before_starting_anything(capsys) -> None:
    assert main(["up", "--gateways", "0"]) == 1
    assert "--gateways must be >= 1" in capsys.readouterr().err


def test_up_runs_tensor_parallel_groups_in_colocated_workers_only(capsys) -> None:
    assert main(["up", "--prefill", "1", "--decode", "1", "--tp", "3"]) == 1
    assert "--tp 3 runs in colocated workers only" in capsys.readouterr().err
    assert main(["up", "--colocated", "--ep", "2", "--tp", "4"]) == 1
    assert "does not combine with --tp 4: give --tp 2" in capsys.readouterr().err
    # --tp 2 beside --ep decode=2: the prefill worker would be a tensor-parallel group.
    assert main(["up", "--prefill", "1", "--decode", "1", "--ep", "decode=2", "--tp",
                 "2"]) == 1
    assert "--tp 2 runs in colocated workers only" in capsys.readouterr().err


def test_up_refuses_a_split_the_model_cannot_take_before_starting_anything(capsys) -> None:
    # The default model is dense (and its 3 KV heads do not split in two).
    assert main(["up", "--prefill", "1", "--decode", "1", "--ep", "decode=2"]) == 1
    assert "(--ep) needs a mixture-of-experts model" in capsys.readouterr().err
    assert main(["up", "--colocated", "--tp", "2"]) == 1
    assert "does not divide the model's 3 KV heads" in capsys.readouterr().err
    assert main(["up", "--ep", "prefill=two"]) == 1
    assert "--ep: 'two' is not a whole number" in capsys.readouterr().err


def test_up_refuses_a_group_wider_than_the_hosts_gpus(capsys) -> None:
    import shutil

    if shutil.which("nvidia-smi") is not None:
        pytest.skip("counts this host's GPUs: on a CPU-only host it has none")
    assert main(["up", "--device", "cuda", "--colocated", "--workers", "1", "--tp", "3"]) == 1
    assert ("a worker of 3 processes on cuda needs one GPU per process, up to cuda:2; this "
            "host has 0") in capsys.readouterr().err


def test_ep_sizes_by_role() -> None:
    roles = [Role.PREFILL, Role.PREFILL, Role.DECODE, Role.COLOCATED]
    assert parse_sizes_by_role("--ep", None, roles) == [1, 1, 1, 1]
    assert parse_sizes_by_role("--ep", "2", roles) == [2, 2, 2, 2]
    assert parse_sizes_by_role("--ep", "prefill=2, decode=4", roles) == [2, 2, 4, 1]
    for text, message in (("0", "at least 1"), ("prefill=2,prefill=4", "given twice"),
                          ("gpu=2", "--ep: unknown role 'gpu'"), ("prefill=", "is not ROLE=N"),
                          ("=2", "is not ROLE=N"), ("decode=x", "not a whole number")):
        with pytest.raises(ValueError, match=message):
            parse_sizes_by_role("--ep", text, roles)


def test_host_kv_tier_is_a_share_of_available_memory_on_cuda_and_off_on_cpu():
    from launcher.memory_defaults import host_kv_cache_gb

    # 25% of 512 GiB over 4 GPU workers = 32 GiB each; capped at 64; CPU or unknown: off.
    assert host_kv_cache_gb(["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 512 << 30) == 32.0
    assert host_kv_cache_gb(["cuda:0"], 2048 << 30) == 64.0
    assert host_kv_cache_gb(["cuda:0"], 3 << 30) == 0.7
    assert host_kv_cache_gb(["cpu", "cpu"], 512 << 30) == 0.0
    assert host_kv_cache_gb(["cuda:0"], None) == 0.0


def test_each_cuda_worker_gets_an_even_share_of_its_gpu_and_cpu_workers_none():
    from launcher.memory_defaults import GPU_MEMORY_SHARE, gpu_memory_fractions

    assert gpu_memory_fractions(["cuda:0"]) == [GPU_MEMORY_SHARE]
    assert gpu_memory_fractions(["cuda:0", "cuda:0", "cuda:1"]) == [0.45, 0.45, 0.9]
    assert gpu_memory_fractions(["cpu", "cpu"]) == [None, None]
    assert sum(gpu_memory_fractions(["cuda:0"] * 4)) <= GPU_MEMORY_SHARE


def test_up_refuses_cuda_workers_without_ucxx_before_starting_anything(capsys, monkeypatch,
                                                                        tmp_path) -> None:
    import kv_transfer.transport_choice

    monkeypatch.setattr(kv_transfer.transport_choice, "ucx_available", lambda: False)
    assert main(["up", "--device", "cuda", "--no-mps", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "ucxx is not installed" in err and "pip install ucxx-cu13" in err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
