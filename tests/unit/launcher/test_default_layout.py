"""What `pdserve up` runs without role options: the layout measured best on the host."""

from __future__ import annotations

from pathlib import Path

from launcher.default_layout import (NUM_SMALL_MODEL_WORKERS, SMALL_MODEL_BYTES, default_roles,
                                     model_weight_bytes)
from launcher.role_options import worker_roles
from protocol.messages import Role


def test_a_cpu_runs_two_workers_that_take_either_role() -> None:
    assert default_roles(0, 100 << 20, mps_available=False) == [Role.BOTH, Role.BOTH]


def test_one_gpu_runs_a_small_model_on_colocated_workers_under_mps() -> None:
    assert default_roles(1, SMALL_MODEL_BYTES, mps_available=True) == \
        [Role.COLOCATED] * NUM_SMALL_MODEL_WORKERS
    # Without MPS, several processes would time-slice the GPU: one colocated worker.
    assert default_roles(1, 100 << 20, mps_available=False) == [Role.COLOCATED]


def test_a_larger_model_on_one_gpu_runs_one_colocated_worker() -> None:
    assert default_roles(1, SMALL_MODEL_BYTES + 1, mps_available=True) == [Role.COLOCATED]
    assert default_roles(1, None, mps_available=True) == [Role.COLOCATED]


def test_several_gpus_run_one_prefill_and_one_decode_worker() -> None:
    assert default_roles(4, 100 << 20, mps_available=True) == [Role.PREFILL, Role.DECODE]
    assert default_roles(2, None, mps_available=False) == [Role.PREFILL, Role.DECODE]


def test_role_options_replace_the_default() -> None:
    default = [Role.BOTH, Role.BOTH]
    assert worker_roles(None, None, False, None, None, default) == default
    assert worker_roles(1, None, False, None, None, default) == [Role.PREFILL, Role.DECODE]
    assert worker_roles(None, None, True, None, None, default) == [Role.COLOCATED] * 2
    assert worker_roles(None, None, False, 1, "decode", default) == [Role.DECODE]


def test_the_model_size_is_its_weight_files(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert model_weight_bytes(str(tmp_path)) == 500
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"y" * 42)
    assert model_weight_bytes(str(gguf)) == 42
    assert model_weight_bytes(str(tmp_path / "absent")) is None
    size = model_weight_bytes("default")  # the packaged GGUF, about 98 MB
    assert size is not None and 50 << 20 < size < SMALL_MODEL_BYTES
