"""CUDA MPS under `pdserve up`: which workers share a GPU, their SM and memory shares, the
variables each worker gets, and the private daemon's start / quit (against a stand-in
for nvidia-cuda-mps-control: there is no GPU here)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from launcher.local_cluster import LocalCluster, WorkerSpec
from launcher.mps import (GpuShare, MpsDaemon, MpsError, MpsWorker, describe, find_control_binary,
                          gpu_index, mps_root, parse_sm_share, plan_gpu_shares,
                          query_total_memory_mib, smi_device_id, worker_envs)
from protocol.messages import Role

DAEMON_ENV = {"CUDA_MPS_PIPE_DIRECTORY": "/x/mps/pipe", "CUDA_MPS_LOG_DIRECTORY": "/x/mps/log"}


def workers(*specs: str) -> list[MpsWorker]:
    """"prefill@cuda:0" → MpsWorker("prefill-0", "prefill", "cuda:0"), counted per role."""
    out: list[MpsWorker] = []
    counts: dict[str, int] = {}
    for spec in specs:
        role, device = spec.split("@")
        out.append(MpsWorker(f"{role}-{counts.get(role, 0)}", role, device))
        counts[role] = counts.get(role, 0) + 1
    return out


# ---------------------------------------------------------------- --sm-share

def test_sm_share_parses_role_percent_pairs() -> None:
    assert parse_sm_share("prefill=60,decode=40") == {"prefill": 60, "decode": 40}
    assert parse_sm_share(" both = 50 ") == {"both": 50}
    assert parse_sm_share(None) == {} and parse_sm_share("") == {}


@pytest.mark.parametrize(("spec", "message"), [
    ("prefill60", "is not ROLE=PERCENT"), ("prefill=60,", "is not ROLE=PERCENT"),
    ("=60", "is not ROLE=PERCENT"), ("prefil=60", "unknown role 'prefil'"),
    ("decode=0", "from 1 to 100"), ("decode=101", "from 1 to 100"),
    ("decode=12.5", "from 1 to 100"), ("decode=-5", "from 1 to 100"),
    ("decode=40,decode=50", "decode is given twice")])
def test_bad_sm_shares_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sm_share(spec)


# ---------------------------------------------------------------- who shares which GPU

def test_gpu_index_reads_cuda_devices_only() -> None:
    assert [gpu_index(d) for d in ("cuda:0", "cuda:3", "cuda", "cpu", "cuda:x")] == [
        0, 3, 0, None, None]


def test_workers_sharing_a_gpu_split_its_sms_equally_by_default() -> None:
    shares = plan_gpu_shares(workers("prefill@cuda:0", "decode@cuda:0"), {})
    assert shares == [GpuShare(0, (0, 1), (50, 50))]
    shares = plan_gpu_shares(workers("both@cuda", "both@cuda", "both@cuda"), {})
    assert shares == [GpuShare(0, (0, 1, 2), (33, 33, 33))]


def test_round_robin_over_two_gpus_gives_two_shared_gpus() -> None:
    shares = plan_gpu_shares(workers("prefill@cuda:0", "prefill@cuda:1", "decode@cuda:0",
                                     "decode@cuda:1"), {})
    assert shares == [GpuShare(0, (0, 2), (50, 50)), GpuShare(1, (1, 3), (50, 50))]


def test_no_gpu_is_shared_with_one_worker_per_gpu_or_on_the_cpu() -> None:
    assert plan_gpu_shares(workers("prefill@cuda:0", "decode@cuda:1"), {}) == []
    assert plan_gpu_shares(workers("prefill@cpu", "decode@cpu"), {}) == []
    # Only the shared GPU is planned; the worker alone on cuda:1 keeps all of it.
    assert plan_gpu_shares(workers("prefill@cuda:0", "decode@cuda:1", "decode@cuda:0"),
                           {}) == [GpuShare(0, (0, 2), (50, 50))]


def test_sm_share_sets_each_roles_percent_and_the_rest_is_split() -> None:
    pool = workers("prefill@cuda:0", "decode@cuda:0")
    assert plan_gpu_shares(pool, {"prefill": 60, "decode": 40})[0].sm_percents == (60, 40)
    assert plan_gpu_shares(pool, {"prefill": 70})[0].sm_percents == (70, 30)
    pool = workers("prefill@cuda:0", "decode@cuda:0", "decode@cuda:0")
    assert plan_gpu_shares(pool, {"prefill": 40})[0].sm_percents == (40, 30, 30)
    assert plan_gpu_shares(pool, {"decode": 30})[0].sm_percents == (40, 30, 30)


def test_shares_over_100_percent_on_a_gpu_are_refused_with_the_workers_named() -> None:
    pool = workers("prefill@cuda:0", "decode@cuda:0", "decode@cuda:0")
    with pytest.raises(ValueError, match=r"cuda:0 add up to more than 100% \(prefill-0 60%, "
                                         r"decode-0 50%, decode-1 50%\)"):
        plan_gpu_shares(pool, {"prefill": 60, "decode": 50})
    with pytest.raises(ValueError, match="at least 1% each for decode-0, decode-1"):
        plan_gpu_shares(pool, {"prefill": 100})
    # The same shares fit when each GPU holds only part of the pool.
    spread = workers("prefill@cuda:0", "decode@cuda:1", "prefill@cuda:0", "decode@cuda:1")
    assert [s.sm_percents for s in plan_gpu_shares(spread, {"prefill": 50, "decode": 50})
            ] == [(50, 50), (50, 50)]


def test_sm_share_for_a_role_no_worker_has_is_refused() -> None:
    with pytest.raises(ValueError, match="names both, but no worker has that role"):
        plan_gpu_shares(workers("prefill@cuda:0", "decode@cuda:0"), {"both": 50})


# ---------------------------------------------------------------- environments

def test_workers_on_a_shared_gpu_get_sm_percent_and_memory_cap() -> None:
    pool = workers("prefill@cuda:1", "decode@cuda:1", "decode@cuda:0")
    shares = plan_gpu_shares(pool, {"prefill": 60, "decode": 40})
    envs = worker_envs(3, shares, DAEMON_ENV, {1: 143771}, None)
    assert envs[0] == {**DAEMON_ENV, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60",
                       "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=71885M"}
    assert envs[1]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert envs[1]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=71885M"
    assert envs[2] == DAEMON_ENV  # alone on cuda:0: the daemon's folders, no limits


def test_without_the_total_memory_no_memory_limit_is_set() -> None:
    shares = plan_gpu_shares(workers("both@cuda:0", "both@cuda:0"), {})
    envs = worker_envs(2, shares, DAEMON_ENV, {}, None)
    assert all("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env for env in envs)
    assert [env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for env in envs] == ["50", "50"]


def test_visible_devices_are_renumbered_for_the_daemons_clients() -> None:
    shares = plan_gpu_shares(workers("both@cuda:0", "both@cuda:0"), {})
    envs = worker_envs(2, shares, DAEMON_ENV, {}, "2,GPU-abc")
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "0,1"]
    assert smi_device_id(1, "2,GPU-abc") == "GPU-abc"
    assert smi_device_id(1, None) == "1" and smi_device_id(0, "") == "0"


def test_the_line_names_each_workers_share() -> None:
    pool = workers("prefill@cuda:0", "decode@cuda:0")
    share, = plan_gpu_shares(pool, {"prefill": 60, "decode": 40})
    assert describe(share, pool, 143771, None) == (
        "CUDA MPS on cuda:0: prefill-0 60% SMs, decode-0 40% SMs; 71885 MiB of memory each")
    assert describe(share, pool, None, "nvidia-smi timed out").endswith(
        "; no memory limit (nvidia-smi timed out)")


def test_a_long_log_dir_gets_a_short_private_pipe_folder(tmp_path: Path) -> None:
    assert mps_root(Path("/tmp/pdserve-up-abc")) == Path("/tmp/pdserve-up-abc/mps")
    deep = tmp_path / ("d" * 80)
    root = mps_root(deep)
    try:
        assert not str(root).startswith(str(deep)) and len(str(root / "pipe")) <= 64
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
    finally:
        root.rmdir()


# ---------------------------------------------------------------- processes (stand-ins)

FAKE_CONTROL = """#!/bin/sh
# Stands in for nvidia-cuda-mps-control: records argv, the MPS folders and stdin.
{ echo "argv=$*"; echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"; echo "log=$CUDA_MPS_LOG_DIRECTORY"
  echo "stdin=$(cat)"; echo "--"; } >> "$FAKE_MPS_RECORD"
if [ "$1" = "-d" ] && [ -z "$FAKE_MPS_NO_PID" ]; then
  echo $$ > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"
fi
[ -n "$FAKE_MPS_FAIL" ] && { echo "$FAKE_MPS_FAIL"; exit 1; }
exit 0
"""


def install(bin_dir: Path, name: str, text: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(text)
    path.chmod(0o755)


def calls(record: Path) -> list[dict[str, str]]:
    if not record.exists():
        return []
    blocks = record.read_text().split("--\n")
    return [dict(line.split("=", 1) for line in block.splitlines()) for block in blocks
            if block.strip()]


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    install(tmp_path / "bin", "nvidia-cuda-mps-control", FAKE_CONTROL)
    monkeypatch.setenv("FAKE_MPS_RECORD", str(tmp_path / "record"))
    binary = find_control_binary(f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert binary == str(tmp_path / "bin" / "nvidia-cuda-mps-control")
    return binary


def test_the_daemon_starts_with_its_own_folders_and_quits_on_stop(
        tmp_path: Path, fake_control: str) -> None:
    daemon = MpsDaemon(fake_control, tmp_path / "cluster" / "mps")
    daemon.start(dict(os.environ))
    started, = calls(tmp_path / "record")
    assert started["argv"] == "-d" and started["stdin"] == ""
    assert started["pipe"] == str(tmp_path / "cluster" / "mps" / "pipe")
    assert started["log"] == str(tmp_path / "cluster" / "mps" / "log")
    assert daemon.env == {"CUDA_MPS_PIPE_DIRECTORY": started["pipe"],
                          "CUDA_MPS_LOG_DIRECTORY": started["log"]}
    assert stat.S_IMODE(daemon.pipe_dir.stat().st_mode) == 0o700
    daemon.stop()
    daemon.stop()  # at most once
    _, quit_call = calls(tmp_path / "record")
    assert quit_call == {"argv": "", "pipe": started["pipe"], "log": started["log"],
                         "stdin": "quit"}


def test_a_daemon_that_fails_to_start_says_why_and_is_not_told_to_quit(
        tmp_path: Path, fake_control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL", "An instance of this daemon is already running")
    daemon = MpsDaemon(fake_control, tmp_path / "mps")
    with pytest.raises(MpsError, match="exit code 1: An instance of this daemon is already "
                                       "running.*--no-mps"):
        daemon.start(dict(os.environ))
    daemon.stop()
    assert [c["argv"] for c in calls(tmp_path / "record")] == ["-d"]


def test_a_daemon_without_a_pid_file_is_told_to_quit(
        tmp_path: Path, fake_control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_MPS_NO_PID", "1")
    daemon = MpsDaemon(fake_control, tmp_path / "mps", timeout_s=0.3)
    with pytest.raises(MpsError, match="wrote no .*nvidia-cuda-mps-control.pid"):
        daemon.start(dict(os.environ))
    assert [c["argv"] for c in calls(tmp_path / "record")] == ["-d", ""]
    assert not daemon.is_running


def test_the_cluster_quits_its_daemon_when_start_up_fails_half_way(
        tmp_path: Path, fake_control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = MpsDaemon(fake_control, tmp_path / "mps")
    spec = WorkerSpec(Role.BOTH, "cuda:0", "both-0-abc",
                      env={**daemon.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})
    cluster = LocalCluster([spec], [], [], "http://127.0.0.1:1", tmp_path, "redis://x",
                           lambda line: None, mps=daemon)
    spawned_envs = []

    def refuse(name: str, argv: list[str], env: dict[str, str], **kwargs: object) -> None:
        spawned_envs.append(env)
        raise OSError("no more processes")

    monkeypatch.setattr(cluster.supervisor, "start", refuse)
    with pytest.raises(OSError):
        cluster.start()
    cluster.stop()
    assert [c["argv"] for c in calls(tmp_path / "record")] == ["-d", ""]
    # The worker was to get the cluster's environment plus its own MPS variables.
    env, = spawned_envs
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["PDSERVE_INTERNAL_TOKEN"] == cluster.token and env["PATH"]


def test_total_memory_comes_from_nvidia_smi(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    install(tmp_path / "bin", "nvidia-smi", '#!/bin/sh\n[ "$4" = 0 ] && { echo 143771; '
                                            'exit 0; }\necho "No devices were found"; '
                                            'exit 6\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert query_total_memory_mib("0") == 143771
    with pytest.raises(MpsError, match="nvidia-smi -i 7 answered 'No devices were found'"):
        query_total_memory_mib("7")
