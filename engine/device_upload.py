"""Host values onto the device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy first
waits for everything queued before it on the stream: a step that builds its inputs that
way cannot be queued while the previous step computes. `to_device` stages the values in
pinned memory and queues an asynchronous copy instead; the caching host allocator keeps
the staging block until the copy has run (it records the copy's stream), so the caller
may drop it at once. Off CUDA it is a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A new tensor on `device` holding `values`; on CUDA, queued behind the stream's work."""
    host = (torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray)
            else torch.tensor(values, dtype=dtype))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(target: torch.Tensor, values: np.ndarray) -> None:
    """`target.copy_(values)` into a device tensor, queued behind the stream's work."""
    host = torch.from_numpy(values)
    if target.device.type != "cuda":
        target.copy_(host)
        return
    target.copy_(host.pin_memory(), non_blocking=True)
