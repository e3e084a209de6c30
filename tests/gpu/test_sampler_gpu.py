"""The sampler on a CUDA device never waits for it: `Sampler.launch` queues its work behind
the step in flight (every index and parameter goes up through pinned memory), so an
overlapped engine can queue the next step before this one's tokens land. CUDA's sync
debug mode turns any wait (a pageable upload, a list index, `.item()`) into an error.

The tokens themselves are checked against the CPU in tests/unit/engine/test_sampler.py's
rules and, end to end, by tests/gpu/test_engine_overlapped_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingState
from protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 1000
EOS = 2

BATCHES = {
    "all default (temperature 1)": [SamplingParams()] * 6,
    "greedy and random": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                          SamplingParams(temperature=0.0, logprobs=2), SamplingParams()],
    "truncations": [SamplingParams(top_k=20), SamplingParams(top_p=0.8),
                    SamplingParams(min_p=0.05, temperature=1.3), SamplingParams()],
    "seeded": [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=8, top_k=5)],
    "edits": [SamplingParams(min_tokens=4, stop_token_ids=(5,)),
              SamplingParams(repetition_penalty=1.2),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.2),
              SamplingParams(logit_bias=((3, 5.0),), temperature=0.0), SamplingParams()],
    "some logprobs": [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)],
}


@pytest.mark.parametrize("name", BATCHES)
def test_launch_never_waits_for_the_device(name: str) -> None:
    params = BATCHES[name]
    sampler = Sampler([EOS], device="cuda", seed=0)
    states = []
    for p in params:
        state = SamplingState.create(p, [1, 5, 9], device="cuda")
        state.output_token_ids.extend([5, 7])
        states.append(state)
    logits = torch.randn(len(params), VOCAB, device="cuda", generator=torch.Generator(
        "cuda").manual_seed(1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = sampler.launch(logits, params, states)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = pending.result().token_ids
    assert len(tokens) == len(params) and all(0 <= t < VOCAB for t in tokens)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    edited = logits.clone()
    for i in greedy:
        for token_id, bias in params[i].logit_bias:
            edited[i, token_id] += bias
        assert tokens[i] == int(edited[i].argmax())
