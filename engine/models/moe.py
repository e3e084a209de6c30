"""The mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral): a router picks `top_k`
of `num_experts` gated MLPs per token and the block sums their outputs, each weighted by
its routing probability.

    probs   = softmax(gate(x))                   float32, [T, num_experts]
    w, ids  = topk(probs, top_k)                 [T, top_k]; w /= sum(w) when renormalize
    out[t]  = sum_j w[t, j] * expert[ids[t, j]](x[t])
            (+ sigmoid(shared_expert_gate(x[t])) * shared_expert(x[t])   Qwen2-MoE)

The tokens are grouped by expert rather than looped over: the T * top_k (token, expert)
assignments are sorted by expert id, the tokens gathered once in that order, each expert
runs one matmul chain over its contiguous slice, and one scatter-add puts the weighted
outputs back on their tokens.

    assignments sorted by expert:  | expert 0 rows | expert 1 rows | ... | expert E-1 rows |
                                   0              c0              c0+c1                T*top_k
    (c_e = number of assignments to expert e; a slice may be empty)

The slice bounds are read on the host (one sync per block), so this path runs on any
device with plain torch ops but cannot be captured in a CUDA graph. The kernel path
(`forward_kernels`, after `fuse_experts`) groups the assignments on the device instead and
runs each projection of every expert as one grouped GEMM (engine/kernels/fused_moe.py):
no host sync, no loop over experts, so its steps are captured in CUDA graphs like a dense
model's. The experts' weights then live in two stacked tensors, `w13` [E, 2I, H] (gate
rows, then up rows) and `w2` [E, H, I], each expert's projections being views of them.

Tensor parallel: each rank holds a slice of every expert's width and the whole router
(engine/tensor_parallel_sharding.py), so it routes exactly as the others do and returns
partial sums that the decoder layer's all-reduce adds up. A shared expert is sliced as a
dense MLP, its one-output gate whole on every rank. Expert parallel (`shares` set,
engine/expert_parallel.py): each rank holds whole experts instead and computes only the
rows of the experts it holds (of an expert with k copies, every k-th row from its copy's
index); rank 0, which runs the rest of the model, sends the block's tokens to the other
ranks and sums their rows with its own through `exchange` (engine/expert_exchange.py); its
shared expert is whole, on rank 0 only.

Load: `expert_tokens` counts the (token, expert) assignments of every expert since it was
last read (`take_expert_tokens`), on the block's device, from the counts the grouping
computes anyway. It is zeroed in place when read, never replaced, because a captured graph
keeps adding into the tensor it was captured with. (A graph step's padding rows are routed
and counted too: a padded decode batch adds up to its padding's rows to the counts.)
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import Activation, ModelConfig, MoEConfig
from engine.kernels.gemv import GemvWorkspace
from engine.models.layers import fuse_rows, gated_kernels


class BlockExchange(Protocol):
    """Expert parallelism's exchange as a block on rank 0 uses it."""

    def share(self, block: "MoEBlock", x: torch.Tensor) -> None:
        """Send the block's input tokens to the other ranks."""

    def combine(self, routed: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of the routed outputs."""


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), as the dense gated MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class MoEBlock(nn.Module):
    """`gate` is the router ([num_experts, hidden]); `experts[e]` expert e.

    `round_weights`: the routing weights are rounded to the model dtype before they scale
    the expert outputs (Qwen3-MoE); otherwise the product is taken in float32 and rounded
    after (Mixtral). Both are exact in float32 and differ by one rounding in bf16."""

    def __init__(self, hidden_size: int, moe: MoEConfig, activation: Activation,
                 round_weights: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))
        shared = moe.shared_intermediate_size
        self.shared_expert = Expert(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared else None
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.activation = activation
        self.round_weights = round_weights
        # Made at the first forward, on the input's device (a model may be built on the meta
        # device and materialized without its buffers' values).
        self.expert_tokens: torch.Tensor | None = None
        # The kernel path's stacked expert weights (`fuse_experts`): [E, 2I, H] and [E, H, I].
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        # Expert parallel: expert -> (this rank's copy index, copies); None: all experts here.
        self.shares: dict[int, tuple[int, int]] | None = None
        # Expert parallel, on rank 0: how the other ranks get this block's tokens and give
        # back their experts' rows (engine/expert_exchange.py).
        self.exchange: BlockExchange | None = None

    def take_expert_tokens(self) -> list[int]:
        """The assignments per expert since the last call (and start counting again)."""
        if self.expert_tokens is None:
            return [0] * self.num_experts
        with torch.inference_mode():  # (it was made in inference mode)
            counts = self.expert_tokens.tolist()
            self.expert_tokens.zero_()  # in place: a captured graph adds into this tensor
        return counts

    def _count(self, counts: torch.Tensor) -> None:
        if self.expert_tokens is None or self.expert_tokens.device != counts.device:
            self.expert_tokens = torch.zeros_like(counts)
        self.expert_tokens += counts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, top_k], expert ids long [T, top_k]) for tokens x [T, hidden];
        side-effect free."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        if self.activation is Activation.GELU_TANH:
            return F.gelu(gate, approximate="tanh")
        return F.silu(gate)

    def _expert(self, expert: Expert, rows: torch.Tensor) -> torch.Tensor:
        hidden = self._act(F.linear(rows, expert.gate_proj.weight)) * F.linear(
            rows, expert.up_proj.weight)
        return F.linear(hidden, expert.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exchange is None:
            return self._with_shared(x, self.routed(x))
        self.exchange.share(self, x)  # the expert ranks compute their experts' rows of x
        return self._with_shared(x, self.exchange.combine(self.routed(x)))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for tokens x [T, hidden] (no shared expert); with
        `shares`, only the rows of the experts this rank holds (zero elsewhere)."""
        weights, expert_ids = self.route(x)
        flat_ids = expert_ids.reshape(-1)
        # Stable: an expert's rows keep token order, so results do not depend on the sort.
        order = torch.argsort(flat_ids, stable=True)
        token_rows = order // self.top_k
        sorted_weights = weights.reshape(-1)[order]
        if self.round_weights:
            sorted_weights = sorted_weights.to(x.dtype)
        grouped = x[token_rows]
        shares = self.shares
        outputs = torch.empty_like(grouped) if shares is None else torch.zeros_like(grouped)
        counts_on_device = torch.bincount(flat_ids, minlength=self.num_experts)
        self._count(counts_on_device)
        counts = counts_on_device.tolist()  # host sync
        start = 0
        for e, (expert, count) in enumerate(zip(self.experts, counts)):
            share = (0, 1) if shares is None else shares.get(e)
            if count and share is not None:
                # This copy's rows of the expert's slice: every copies-th from its index.
                rows_of = slice(start + share[0], start + count, share[1])
                outputs[rows_of] = self._expert(expert, grouped[rows_of])
            start += count
        weighted = (outputs * sorted_weights[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_rows, weighted)

    def _with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None or self.shared_expert_gate is None:
            return routed
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
        return routed + gate * self._expert(self.shared_expert, x)

    def fuse_experts(self) -> None:
        """Stack the experts' weights into `w13` and `w2` (see the module doc); each expert's
        projections become views of them. Idempotent while the views still alias them.
        Not for an expert-parallel block (its ranks hold different experts)."""
        if self.shares is not None:
            raise ValueError("an expert-parallel block runs the torch path")
        first = self.experts[0]
        if self.w13 is not None and first.gate_proj.weight.data_ptr() == self.w13.data_ptr():
            return
        size = first.gate_proj.weight.shape[0]
        # Rows in expert order: [gate; up] of each expert, then each expert's down.
        self.w13 = fuse_rows([w for e in self.experts
                              for w in (e.gate_proj.weight, e.up_proj.weight)]
                             ).view(self.num_experts, 2 * size, -1)
        self.w2 = fuse_rows([e.down_proj.weight for e in self.experts]
                            ).view(self.num_experts, *first.down_proj.weight.shape)
        for e, expert in enumerate(self.experts):
            expert.gate_proj.weight = nn.Parameter(self.w13[e, :size], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(self.w13[e, size:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(self.w2[e], requires_grad=False)

    def forward_kernels(self, x: torch.Tensor, workspace: GemvWorkspace | None) -> torch.Tensor:
        """The kernel path: the fused grouped GEMMs (engine/kernels/fused_moe.py), after
        `fuse_experts`; the same results as `forward` up to the order of one sum."""
        from engine.kernels.fused_moe import align_by_expert, grouped_gemm, tile_rows

        if self.w13 is None or self.w2 is None:
            raise RuntimeError("forward_kernels before fuse_experts (prepare_kernels)")
        weights, expert_ids = self.route(x)
        n = expert_ids.numel()
        sorted_ids, block_experts, counts = align_by_expert(
            expert_ids, self.num_experts, tile_rows(n, self.num_experts))
        self._count(counts)
        hidden = gated_kernels(grouped_gemm(x, self.w13, sorted_ids, block_experts, n,
                                            self.top_k), self.activation)
        flat_weights = weights.reshape(-1)
        if self.round_weights:
            flat_weights = flat_weights.to(x.dtype)
        outputs = grouped_gemm(hidden, self.w2, sorted_ids, block_experts, n, 1,
                               weights=flat_weights)
        routed = outputs.view(x.shape[0], self.top_k, x.shape[1]).sum(dim=1)
        return self._with_shared(x, routed)



# The expert projections' names in Qwen3-MoE checkpoints (ours too) and in Mixtral's.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def moe_shapes(prefix: str, hidden_size: int, moe: MoEConfig,
               expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES
               ) -> dict[str, tuple[int, ...]]:
    """Every tensor of one block as its checkpoint names it, after `prefix` (the block's
    own, e.g. "model.layers.0.mlp."): the router and, per expert, gate, up and down
    (`expert_names` in that order). The checkpoints store one tensor per expert, as every
    Qwen3-MoE and Mixtral checkpoint on the Hub does and transformers' save_pretrained
    writes (it un-fuses the 3D expert tensors it holds in memory)."""
    i = moe.intermediate_size
    gate, up, down = expert_names
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (moe.num_experts, hidden_size)}
    for e in range(moe.num_experts):
        shapes[f"{prefix}experts.{e}.{gate}.weight"] = (i, hidden_size)
        shapes[f"{prefix}experts.{e}.{up}.weight"] = (i, hidden_size)
        shapes[f"{prefix}experts.{e}.{down}.weight"] = (hidden_size, i)
    if (shared := moe.shared_intermediate_size):
        shapes[prefix + "shared_expert_gate.weight"] = (1, hidden_size)
        shapes[prefix + "shared_expert.gate_proj.weight"] = (shared, hidden_size)
        shapes[prefix + "shared_expert.up_proj.weight"] = (shared, hidden_size)
        shapes[prefix + "shared_expert.down_proj.weight"] = (hidden_size, shared)
    return shapes


def sparse_mlp(config: ModelConfig, n: int) -> MoEBlock | None:
    """Layer n's expert block in a Qwen-style MoE family (Qwen3-MoE, Qwen2-MoE: the routing
    weights rounded to the model dtype), or None where the layer keeps its dense MLP."""
    if config.moe is None or not config.is_moe_layer(n):
        return None
    return MoEBlock(config.hidden_size, config.moe, config.hidden_act, round_weights=True)


def with_moe_shapes(config: ModelConfig, prefix: str, shapes: dict[str, tuple[int, ...]]
                    ) -> dict[str, tuple[int, ...]]:
    """A dense layer's `shapes` with, where the layer at `prefix` is sparse, its MLP's
    tensors replaced by the block's (Qwen-style names: `mlp.gate`, `mlp.experts.E.*`)."""
    n = int(prefix.rstrip(".").rsplit(".", 1)[1])
    if config.moe is None or not config.is_moe_layer(n):
        return shapes
    for name in [name for name in shapes if name.startswith(prefix + "mlp.")]:
        del shapes[name]
    shapes.update(moe_shapes(prefix + "mlp.", config.hidden_size, config.moe))
    return shapes
