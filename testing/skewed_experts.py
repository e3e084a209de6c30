"""A mixture-of-experts checkpoint skewed so that chosen experts take every token: the test
model for expert load and its rebalancing (tests only; the weights are a copy).

Every token's hidden state gets +4 in dimension 0 (from the embeddings, through the residual
stream), and each MoE layer's router row of a chosen expert reads that dimension with the
weight given, so those experts win every token, in that order of weight.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path


def skew_experts(source: Path, target: Path, reads: Mapping[int, float]) -> Path:
    """`source` (a safetensors checkpoint folder) copied to `target` with the router rows of
    the experts in `reads` (expert -> weight on dimension 0) made to win; returns `target`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    (weights,) = target.glob("*.safetensors")
    state = load_file(weights)
    state["model.embed_tokens.weight"][:, 0] += 4.0
    for name, tensor in state.items():
        if name.endswith("mlp.gate.weight"):
            for expert, weight in reads.items():
                tensor[expert, 0] = weight
    save_file(state, weights, metadata={"format": "pt"})
    return target
