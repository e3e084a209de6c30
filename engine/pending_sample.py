"""PendingSample: one step's sampled tokens, on the device now and on their way to the host.

    Sampler.launch ──▶ PendingSample(token_ids on the device) ──copy (no wait)──▶ host
                              │                                                   │
                              └─▶ the next step's decode inputs      result() ◀───┘ waits here

`Sampler.launch` queues the sampling and one copy of everything the host needs (the tokens,
and for rows that asked for logprobs the chosen token's logprob and the top alternatives)
without waiting for the device; `result()` waits for that copy only (on CUDA an event wait,
which releases the GIL) and builds the `SamplerOutput`. An overlapped engine step
(engine/llm_engine.py) feeds `token_ids` into the next step's inputs before `result()`.

On the CPU the copies are plain and `result()` does not wait.

Invariants: `token_ids` is a 1-D long tensor with one token per row; `result()` returns the
same output however often it is called (the host copy is read, never rewritten).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.device_upload import to_device
from engine.sampler_output import SamplerOutput, TokenLogprobs
from protocol.sampling_params import SamplingParams


class PendingSample:
    """What `Sampler.launch` returns; see the module doc."""

    __slots__ = ("token_ids", "_params", "_host", "_done", "_lp_rows", "_output")

    def __init__(self, token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                 params: Sequence[SamplingParams], no_logprobs: bool = False) -> None:
        """`no_logprobs`: the caller knows no row asks for logprobs (no pass to find them)."""
        if token_ids.dim() != 1 or token_ids.shape[0] != len(params):
            raise ValueError(f"{tuple(token_ids.shape)} sampled tokens for {len(params)} rows")
        self.token_ids = token_ids
        self._params = list(params)
        self._lp_rows = [] if no_logprobs else [i for i, p in enumerate(params)
                                                if p.logprobs is not None]
        assert not (no_logprobs and raw_logprobs is not None), "logprobs computed for nobody"
        device_parts = [token_ids]
        if self._lp_rows:
            assert raw_logprobs is not None, "logprobs asked for but not computed"
            rows = self._lp_rows
            if len(rows) == len(params):
                lp, chosen = raw_logprobs, token_ids
            else:  # the index through pinned memory: a list index waits for the device
                index = to_device(rows, torch.long, token_ids.device)
                lp, chosen = raw_logprobs.index_select(0, index), token_ids.index_select(0, index)
            device_parts.append(lp.gather(1, chosen.unsqueeze(1)).squeeze(1))
            k = min(max(params[i].logprobs or 0 for i in rows), lp.shape[1])
            if k > 0:
                values, ids = lp.topk(k, dim=-1)
                device_parts += [values, ids]
        on_cuda = token_ids.is_cuda
        self._host = [_to_host(part, on_cuda) for part in device_parts]
        self._done: torch.cuda.Event | None = None
        if on_cuda:
            self._done = torch.cuda.Event()
            self._done.record()
        self._output: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """The tokens (and logprobs) on the host; waits for the copy, not for later work."""
        if self._output is not None:
            return self._output
        if self._done is not None:
            self._done.synchronize()
        host = self._host
        token_ids = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(self._params)
        if self._lp_rows:
            chosen = host[1].tolist()
            values = host[2].tolist() if len(host) > 2 else None
            ids = host[3].tolist() if len(host) > 2 else None
            for j, i in enumerate(self._lp_rows):
                num_top = self._params[i].logprobs or 0
                top_ids = tuple(ids[j][:num_top]) if ids is not None and num_top else ()
                top_values = tuple(values[j][:num_top]) if values is not None and num_top else ()
                logprobs[i] = TokenLogprobs(token_ids[i], chosen[j], top_ids, top_values)
        self._output = SamplerOutput(token_ids=token_ids, logprobs=logprobs)
        return self._output


def _to_host(tensor: torch.Tensor, on_cuda: bool) -> torch.Tensor:
    if not on_cuda:
        return tensor.detach().clone() if tensor.device.type == "cpu" else tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
