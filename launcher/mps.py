"""CUDA MPS for `pdserve up`: several workers on one GPU, each with a fixed share of it.

Without MPS, the processes on one GPU time-slice it: one context runs at a time, so a
prefill worker's long kernels stall a decode worker's short steps. Under MPS their kernels
run side by side, each client held to `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of the SMs and
`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` of the memory. pdserve only starts a control daemon of
its own (its pipe and log folders inside the cluster's folder, never the system's
/tmp/nvidia-mps) and sets those variables per worker; it never changes a device setting
(compute mode, clocks).

    which workers share a GPU (`plan_gpu_shares`: pure)  →  each one's SM percent
    →  the GPU's total memory (`query_total_memory_mib`: nvidia-smi)  →  one env per worker
    (`worker_envs`: pure)  →  MpsDaemon.start()  →  the workers  …  the workers stop
    →  MpsDaemon.stop()

With CUDA_VISIBLE_DEVICES set, the daemon sees only those GPUs and renumbers them 0..k-1
for its clients (NVIDIA's MPS guide: a client that keeps the original list fails), so the
workers get the renumbered list; "cuda:N" keeps its meaning.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.messages import Role

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_DIR_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIR_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MEMORY_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# The daemon writes its pid here once it runs (NVIDIA's MPS guide, "Utilities and Daemons").
PID_FILE_NAME = "nvidia-cuda-mps-control.pid"
# The pipe folder holds UNIX sockets, whose paths may not exceed 107 bytes.
MAX_PIPE_DIR_CHARS = 64
_ROLE_NAMES = tuple(role.value for role in Role)


class MpsError(RuntimeError):
    """The MPS daemon or nvidia-smi did not do what was asked; the message says why."""


@dataclass(frozen=True, slots=True)
class MpsWorker:
    name: str  # e.g. "prefill-0", for messages
    role: str  # prefill | decode | both | colocated: what --sm-share names
    device: str  # "cuda:0", "cuda" (= cuda:0) or "cpu"


@dataclass(frozen=True, slots=True)
class GpuShare:
    """One GPU that several workers share; `worker_positions[i]` gets `sm_percents[i]`."""

    gpu_index: int
    worker_positions: tuple[int, ...]  # positions in the cluster's worker list
    sm_percents: tuple[int, ...]

    def memory_limit_mib(self, total_mib: int) -> int:
        """Each worker's memory cap: an equal split of the GPU's memory."""
        return total_mib // len(self.worker_positions)


# ---------------------------------------------------------------- pure: shares

def parse_sm_share(spec: str | None) -> dict[str, int]:
    """`"prefill=60,decode=40"` → {"prefill": 60, "decode": 40}; None or "" → {}.
    Raises ValueError with a message for the user."""
    shares: dict[str, int] = {}
    if not spec:
        return shares
    for entry in spec.split(","):
        role, sep, percent = (part.strip() for part in entry.partition("="))
        if not sep or not role or not percent:
            raise ValueError(f"--sm-share: {entry.strip()!r} is not ROLE=PERCENT "
                             "(e.g. prefill=60,decode=40)")
        if role not in _ROLE_NAMES:
            raise ValueError(f"--sm-share: unknown role {role!r} (roles: "
                             f"{', '.join(_ROLE_NAMES)})")
        if role in shares:
            raise ValueError(f"--sm-share: {role} is given twice")
        if not percent.isdigit() or not 1 <= int(percent) <= 100:
            raise ValueError(f"--sm-share: {role}={percent}: the percent must be a whole "
                             "number from 1 to 100")
        shares[role] = int(percent)
    return shares


def gpu_index(device: str) -> int | None:
    """"cuda:2" → 2, "cuda" → 0 (torch's default device), anything else → None."""
    if device == "cuda":
        return 0
    prefix, _, index = device.partition(":")
    return int(index) if prefix == "cuda" and index.isdigit() else None


def plan_gpu_shares(workers: Sequence[MpsWorker], sm_share: Mapping[str, int]
                    ) -> list[GpuShare]:
    """The GPUs with more than one worker, and each worker's SM percent; [] when no GPU
    is shared. Side-effect free; raises ValueError with a message for the user.

    A worker whose role `sm_share` names gets that percent; the others on its GPU split
    what is left equally (all of it, 100 // n each, without `sm_share`). Per GPU the
    percents add up to at most 100.
    """
    unused = sorted(set(sm_share) - {w.role for w in workers})
    if unused:
        raise ValueError(f"--sm-share names {', '.join(unused)}, but no worker has that "
                         "role")
    by_gpu: dict[int, list[int]] = {}
    for position, worker in enumerate(workers):
        index = gpu_index(worker.device)
        if index is not None:
            by_gpu.setdefault(index, []).append(position)
    shares = []
    for index, positions in sorted(by_gpu.items()):
        if len(positions) < 2:
            continue
        percents = _split_sms([workers[p] for p in positions], sm_share, f"cuda:{index}")
        shares.append(GpuShare(index, tuple(positions), tuple(percents)))
    return shares


def _split_sms(workers: Sequence[MpsWorker], sm_share: Mapping[str, int], gpu: str
               ) -> list[int]:
    named = [sm_share.get(w.role) for w in workers]
    num_unnamed = named.count(None)
    rest = 100 - sum(p for p in named if p is not None)
    if rest < 0 or (num_unnamed and rest < num_unnamed):
        given = ", ".join(f"{w.name} {p}%" for w, p in zip(workers, named) if p is not None)
        others = ", ".join(w.name for w, p in zip(workers, named) if p is None)
        raise ValueError(f"--sm-share: the SM shares on {gpu} add up to more than 100% "
                         f"({given}" + (f"; and at least 1% each for {others}" if others
                                        else "") + ")")
    return [p if p is not None else rest // num_unnamed for p in named]


# ---------------------------------------------------------------- pure: environments

def smi_device_id(index: int, visible_devices: str | None) -> str:
    """What `nvidia-smi -i` calls the GPU that CUDA numbers `index` (nvidia-smi ignores
    CUDA_VISIBLE_DEVICES; it takes an index or a UUID)."""
    entries = _visible_entries(visible_devices)
    if entries is not None and index < len(entries):
        return entries[index]
    return str(index)


def worker_envs(num_workers: int, shares: Sequence[GpuShare], daemon_env: Mapping[str, str], total_memory_mib: Mapping[int, int],
                visible_devices: str | None) -> list[dict[str, str]]:
    """The MPS variables of each worker (position → extra environment). Side-effect free.

    Every worker gets the daemon's pipe and log folders (and the renumbered
    CUDA_VISIBLE_DEVICES); one on a shared GPU also its SM percent and, where the GPU's
    total memory is known (`total_memory_mib`, by GPU index), its memory cap, keyed by the
    device number the worker itself uses (its "cuda:N").
    """
    base = dict(daemon_env)
    entries = _visible_entries(visible_devices)
    if entries is not None:
        base[VISIBLE_DEVICES_ENV] = ",".join(str(i) for i in range(len(entries)))
    envs = [dict(base) for _ in range(num_workers)]
    for share in shares:
        total_mib = total_memory_mib.get(share.gpu_index)
        for position, percent in zip(share.worker_positions, share.sm_percents):
            envs[position][THREAD_PERCENTAGE_ENV] = str(percent)
            if total_mib is not None:
                envs[position][MEMORY_LIMIT_ENV] = \
                    f"{share.gpu_index}={share.memory_limit_mib(total_mib)}M"
    return envs


def describe(share: GpuShare, workers: Sequence[MpsWorker], total_mib: int | None,
             memory_problem: str | None) -> str:
    """The line `pdserve up` prints for one shared GPU."""
    parts = ", ".join(f"{workers[p].name} {percent}% SMs"
                      for p, percent in zip(share.worker_positions, share.sm_percents))
    memory = (f"{share.memory_limit_mib(total_mib)} MiB of memory each" if total_mib is not None
              else f"no memory limit ({memory_problem})")
    return f"CUDA MPS on cuda:{share.gpu_index}: {parts}; {memory}"


def _visible_entries(visible_devices: str | None) -> list[str] | None:
    if visible_devices is None or not visible_devices.strip():
        return None
    return [entry.strip() for entry in visible_devices.split(",") if entry.strip()]


# ---------------------------------------------------------------- processes

def find_control_binary(path: str | None) -> str | None:
    """nvidia-cuda-mps-control on `path` (a PATH string), if there."""
    return shutil.which(CONTROL_BINARY, path=path)


def query_total_memory_mib(device_id: str, timeout_s: float = 10.0) -> int:
    """The GPU's total memory in MiB, from nvidia-smi; raises MpsError saying why not."""
    argv = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
            "-i", device_id]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise MpsError(f"nvidia-smi did not answer within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise MpsError(f"nvidia-smi could not run: {exc}") from None
    text = out.stdout.strip()
    if out.returncode != 0 or not text.isdigit():
        detail = (out.stderr.strip() or text or "no output").splitlines()[-1]
        raise MpsError(f"nvidia-smi -i {device_id} answered {detail!r} "
                       f"(exit code {out.returncode})")
    return int(text)


def mps_root(log_dir: Path) -> Path:
    """Where a cluster's MPS folders go: `LOG_DIR/mps`, or a new private temporary folder
    when that path is too long for the sockets the daemon makes in it."""
    root = log_dir / "mps"
    if len(str(root.absolute() / "pipe")) <= MAX_PIPE_DIR_CHARS:
        return root
    return Path(tempfile.mkdtemp(prefix="pdserve-mps-"))


class MpsDaemon:
    """One MPS control daemon private to one cluster (its own pipe and log folders).

    Lifecycle: created (nothing runs; `env` is already known, so the workers' environments
    can be built) → start(): `nvidia-cuda-mps-control -d` forks the daemon and returns;
    start() waits for its pid file → running: CUDA processes started with `env` connect to
    it, and it starts the MPS server on the first → stop(), after the workers: "quit" on
    a control client's stdin → stopped.

    Invariants: stop() asks to quit only a daemon that start() launched (or may have: a
    `-d` that timed out), at most once, and is safe in every state (never started, start()
    failed half-way, already stopped); every call of the control program has a deadline.
    """

    def __init__(self, binary: str, root: Path, timeout_s: float = 10.0) -> None:
        self.binary = binary
        self.pipe_dir = root / "pipe"
        self.log_dir = root / "log"
        self.timeout_s = timeout_s
        self.is_running = False
        self._daemon_env: dict[str, str] = {}

    @property
    def env(self) -> dict[str, str]:
        """What the daemon and every client of it need in their environment."""
        return {PIPE_DIR_ENV: str(self.pipe_dir.absolute()),
                LOG_DIR_ENV: str(self.log_dir.absolute())}

    @property
    def pid_file(self) -> Path:
        return self.pipe_dir / PID_FILE_NAME

    def start(self, base_env: Mapping[str, str]) -> None:
        """Launch the daemon with `base_env` (what the workers inherit too) plus `env`;
        raises MpsError, saying why, if it does not run (and then leaves none running)."""
        if self.is_running:
            raise RuntimeError("the MPS daemon is already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.pipe_dir.chmod(0o700)  # whoever reaches its sockets can use the GPU through it
        self._daemon_env = {**base_env, **self.env}
        code, problem = self._control(["-d"], stdin_text=None, name="start")
        if code is None:
            self.is_running = True  # it may have forked before hanging
        if problem is not None:
            self._stop_quietly()
            raise MpsError(f"{CONTROL_BINARY} -d failed ({problem}); is a daemon from an "
                           f"earlier run still using {self.pipe_dir}? Its log: "
                           f"{self.log_dir}. --no-mps starts the cluster without MPS")
        self.is_running = True
        deadline = time.monotonic() + self.timeout_s
        while not self.pid_file.exists():
            if time.monotonic() > deadline:
                self._stop_quietly()
                raise MpsError(f"the MPS daemon wrote no {self.pid_file} within "
                               f"{self.timeout_s:.0f} s; its log: {self.log_dir}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Ask the daemon to quit (it ends once its clients have: call this after the
        workers stopped); raises MpsError if the control program fails or hangs."""
        if not self.is_running:
            return
        self.is_running = False
        _, problem = self._control([], stdin_text="quit\n", name="quit")
        if problem is not None:
            raise MpsError(f"{CONTROL_BINARY} quit failed ({problem}); the daemon's pid "
                           f"is in {self.pid_file}")

    def _stop_quietly(self) -> None:
        try:
            self.stop()
        except MpsError:
            pass  # start() is already failing with the first cause

    def _control(self, args: list[str], stdin_text: str | None, name: str
                 ) -> tuple[int | None, str | None]:
        """Run the control program under the deadline → (exit code, None on a timeout;
        what went wrong, None when it exited 0). Its output goes to a file, not a pipe:
        the forked daemon may keep its parent's descriptors, and reading a pipe would
        wait for the daemon to exit."""
        with open(self.log_dir / f"control-{name}.out", "w+b") as out:
            try:
                done = subprocess.run(
                    [self.binary, *args], env=self._daemon_env, stdout=out,
                    stderr=subprocess.STDOUT, timeout=self.timeout_s,
                    stdin=subprocess.DEVNULL if stdin_text is None else None,
                    input=None if stdin_text is None else stdin_text.encode(),
                    start_new_session=True)
            except subprocess.TimeoutExpired:
                return None, f"no answer within {self.timeout_s:.0f} s"
            except OSError as exc:
                return 127, str(exc)
            out.seek(0)
            lines = out.read().decode(errors="replace").strip().splitlines()
        if done.returncode == 0:
            return 0, None
        return done.returncode, (f"exit code {done.returncode}: "
                                 + (" | ".join(lines[-3:]) or "no output"))
