"""Sections 1-3 of the GPU engine benchmark (benchmarks/engine_gpu.py): every Triton kernel
checked against its torch reference on fresh random inputs, the device's copy and matmul
floors, and each kernel's time beside its floor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BLOCK_SIZE = 16


@dataclass(frozen=True)
class CheckResult:
    kernel: str
    case: str
    max_abs_err: float  # NaN when some output element was never written
    ok: bool  # every element within atol + rtol * |reference|


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def check(self, kernel: str, case: str, pairs) -> CheckResult:
        """One result over several (output, reference) pairs."""
        worst, ok = 0.0, True
        for out, expected in pairs:
            out, expected = out.float(), expected.float()
            diff = (out - expected).abs()
            if diff.isnan().any():
                return CheckResult(kernel, case, float("nan"), False)
            worst = max(worst, float(diff.max()))
            ok = ok and bool((diff <= self.atol + self.rtol * expected.abs()).all())
        return CheckResult(kernel, case, worst, ok)


@dataclass(frozen=True)
class TimingResult:
    kernel: str
    case: str
    time_us: float
    floor_us: float
    floor_kind: str  # "memory" or "matmul"
    # Per call inside one CUDA graph of back-to-back calls: no host launch cost (which
    # dominates `time_us` for tiny kernels, as in a decode step's graph), L2 not flushed.
    graph_us: float

    @property
    def fraction_of_floor(self) -> float:
        return self.floor_us / self.time_us


@dataclass(frozen=True)
class Floors:
    copy_bytes_per_s: float
    matmul_flop_per_s: float


class KernelCases:
    """Builds inputs for every kernel at one model shape; used by both checks and timings."""

    def __init__(self, shape: str, device, dtype, seed: int) -> None:
        import torch

        self.torch = torch
        from testing.shapes import SHAPES  # after main() made the repository importable

        config = SHAPES[shape]
        self.hidden, self.intermediate = config.hidden_size, config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.device, self.dtype = device, dtype
        # Generated on the device: the largest timing case holds 2 GiB of KV per layer.
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int):
        return self.torch.randn(*shape, generator=self.gen, device=self.device,
                                dtype=self.dtype)

    def paged(self, context_lens: list[int]):
        """(k_cache, v_cache, block_tables, context_lens) with shuffled block ids."""
        torch = self.torch
        max_blocks = max(1, max(-(-n // BLOCK_SIZE) for n in context_lens))
        num_blocks = len(context_lens) * max_blocks + 1
        ids = torch.randperm(num_blocks, generator=self.gen, device=self.device)
        tables = ids[:len(context_lens) * max_blocks].view(len(context_lens), max_blocks)
        tables = tables.to(torch.int32)
        k_cache = self.randn(num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
        v_cache = self.randn(num_blocks, BLOCK_SIZE, self.num_kv_heads, self.head_dim)
        lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, tables, lens

    def nan_like(self, t):
        return self.torch.full_like(t, float("nan"))


def check_kernels(cases: KernelCases, tol: Tolerance, small: bool) -> list[CheckResult]:
    """Section 1: each Triton op against its reference, outputs poisoned first."""
    from engine.kernels import (kv_cache_write, paged_decode_attention, prefill_attention, rmsnorm,
                                rope, silu_mul)

    c, torch = cases, cases.torch
    results: list[CheckResult] = []
    num_tokens = 5 if small else 300

    x, weight = c.randn(num_tokens, c.hidden), c.randn(c.hidden)
    out = rmsnorm.rms_norm_triton(x, weight, 1e-5, out=c.nan_like(x))
    results.append(tol.check("rms_norm", f"{num_tokens}x{c.hidden}",
                             [(out, rmsnorm.rms_norm_reference(x, weight, 1e-5))]))
    residual = c.randn(num_tokens, c.hidden)
    ref_x, ref_res = rmsnorm.add_rms_norm_reference_(x.clone(), residual.clone(), weight, 1e-5)
    rmsnorm.add_rms_norm_triton_(x, residual, weight, 1e-5)
    results.append(tol.check("add_rms_norm_", f"{num_tokens}x{c.hidden}",
                             [(x, ref_x), (residual, ref_res)]))

    gate_up = c.randn(num_tokens, 2 * c.intermediate)
    gate, up = gate_up[:, :c.intermediate], gate_up[:, c.intermediate:]
    out = silu_mul.silu_mul_triton(gate, up, out=c.nan_like(gate.contiguous()))
    results.append(tol.check("silu_mul", f"{num_tokens}x{c.intermediate}",
                             [(out, silu_mul.silu_mul_reference(gate, up))]))

    cos, sin = rope.rope_cos_sin(c.head_dim, 8192, 500000.0, None, c.device)
    positions = torch.randint(0, 8192, (num_tokens,), generator=c.gen, device=c.device)
    q = c.randn(num_tokens, c.num_heads, c.head_dim)
    k = c.randn(num_tokens, c.num_kv_heads, c.head_dim)
    ref_q, ref_k = q.clone(), k.clone()
    rope.apply_rope_reference_(ref_q, ref_k, positions, cos, sin)
    rope.apply_rope_triton_(q, k, positions, cos, sin)
    results.append(tol.check("apply_rope_", f"{num_tokens} tokens", [(q, ref_q), (k, ref_k)]))
    results.append(_check_rope_write_kv(c, tol, positions, cos, sin))

    contexts = [1, 17, 40, 0] if small else [1, 17, 600, 2048, 0, 4000]
    k_cache, v_cache, tables, lens = c.paged(contexts)
    poisoned_k, poisoned_v = c.nan_like(k_cache), c.nan_like(v_cache)
    block_ids = tables[:, 0].long()  # slot 0 of each sequence's first block
    new_k = c.randn(len(contexts), c.num_kv_heads, c.head_dim)
    new_v = c.randn(len(contexts), c.num_kv_heads, c.head_dim)
    kv_cache_write.write_kv_cache_triton_(new_k, new_v, poisoned_k, poisoned_v,
                                          block_ids * BLOCK_SIZE)
    results.append(tol.check("write_kv_cache_", f"{len(contexts)} tokens",
                             [(poisoned_k[block_ids, 0], new_k),
                              (poisoned_v[block_ids, 0], new_v)]))

    q = c.randn(len(contexts), c.num_heads, c.head_dim)
    scale = c.head_dim ** -0.5
    expected = paged_decode_attention.paged_decode_attention_reference(
        q, k_cache, v_cache, tables, lens, scale)
    for num_splits in (1, 3):
        out = paged_decode_attention.paged_decode_attention_triton(
            q, k_cache, v_cache, tables, lens, scale, num_splits, out=c.nan_like(q))
        results.append(tol.check("paged_decode_attention",
                                 f"ctx {contexts} splits {num_splits}", [(out, expected)]))

    chunks = [(0, 7), (16, 9), (3, 1)] if small else [(0, 700), (1000, 333), (64, 1)]
    k_cache, v_cache, tables, lens = c.paged([start + n for start, n in chunks])
    offsets = [0]
    for _, n in chunks:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=c.device)
    q = c.randn(offsets[-1], c.num_heads, c.head_dim)
    out = prefill_attention.prefill_attention_triton(
        q, k_cache, v_cache, tables, cu, lens, scale, max(n for _, n in chunks),
        out=c.nan_like(q))
    expected = prefill_attention.prefill_attention_reference(q, k_cache, v_cache, tables, cu,
                                                             lens, scale)
    results.append(tol.check("prefill_attention", f"chunks {chunks}", [(out, expected)]))
    return results


def _check_rope_write_kv(c: KernelCases, tol: Tolerance, positions, cos, sin) -> CheckResult:
    from engine.kernels import rope_kv_write

    num_tokens = positions.shape[0]
    q = c.randn(num_tokens, c.num_heads, c.head_dim)
    k = c.randn(num_tokens, c.num_kv_heads, c.head_dim)
    v = c.randn(num_tokens, c.num_kv_heads, c.head_dim)
    caches = [c.nan_like(c.randn(num_tokens // BLOCK_SIZE + 2, BLOCK_SIZE, c.num_kv_heads,
                                 c.head_dim)) for _ in range(2)]
    slots = c.torch.randperm(caches[0].shape[0] * BLOCK_SIZE, device=c.device)[:num_tokens]
    ref_q, ref_k = q.clone(), k.clone()
    ref_caches = [t.clone() for t in caches]
    rope_kv_write.rope_write_kv_reference_(ref_q, ref_k, v, positions, cos, sin, *ref_caches,
                                           slots)
    rope_kv_write.rope_write_kv_triton_(q, k, v, positions, cos, sin, *caches, slots)
    flat = [t.view(-1, c.num_kv_heads, c.head_dim)[slots.long()] for t in caches + ref_caches]
    return tol.check("rope_write_kv_", f"{num_tokens} tokens",
                     [(q, ref_q), (k, ref_k), (flat[0], flat[2]), (flat[1], flat[3])])


def _bench_us(fn: Callable[[], object]) -> float:
    """Median microseconds, L2 flushed between runs (triton's do_bench)."""
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_us(fn: Callable[[], object]) -> float:
    """Median microseconds per call, calls replayed back to back from one CUDA graph."""
    import triton.testing

    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def measure_floors() -> Floors:
    """Section 2: what this device moves and computes at best, measured now."""
    import torch

    num_bytes = 1 << 30
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _bench_us(lambda: dst.copy_(src)) * 1e-6
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    matmul_s = _bench_us(lambda: a @ b) * 1e-6
    return Floors(copy_bytes_per_s=2 * num_bytes / copy_s, matmul_flop_per_s=2 * n ** 3 / matmul_s)


def time_kernels(cases: KernelCases, floors: Floors) -> list[TimingResult]:
    """Section 3: bf16 kernels at the model's shape; floors from the bytes/FLOPs they need."""
    from engine.kernels import (kv_cache_write, paged_decode_attention, prefill_attention, rmsnorm,
                                rope, rope_kv_write, silu_mul)

    c, torch = cases, cases.torch
    elt = torch.tensor([], dtype=c.dtype).element_size()
    results: list[TimingResult] = []

    def add(kernel: str, case: str, fn: Callable[[], object], num_bytes: float = 0.0,
            num_flops: float = 0.0) -> None:
        if num_flops:
            floor_us, kind = 1e6 * num_flops / floors.matmul_flop_per_s, "matmul"
        else:
            floor_us, kind = 1e6 * num_bytes / floors.copy_bytes_per_s, "memory"
        results.append(TimingResult(kernel, case, _bench_us(fn), floor_us, kind,
                                    _graph_us(fn)))

    for num_tokens in (1, 256, 2048):
        x, res, w = c.randn(num_tokens, c.hidden), c.randn(num_tokens, c.hidden), c.randn(c.hidden)
        add("add_rms_norm_", f"{num_tokens} tokens",
            lambda: rmsnorm.add_rms_norm_triton_(x, res, w, 1e-5),
            num_bytes=(4 * num_tokens * c.hidden + c.hidden) * elt)
        gate, up = c.randn(num_tokens, c.intermediate), c.randn(num_tokens, c.intermediate)
        add("silu_mul", f"{num_tokens} tokens", lambda: silu_mul.silu_mul_triton(gate, up),
            num_bytes=3 * num_tokens * c.intermediate * elt)
        q = c.randn(num_tokens, c.num_heads, c.head_dim)
        k = c.randn(num_tokens, c.num_kv_heads, c.head_dim)
        cos, sin = rope.rope_cos_sin(c.head_dim, 8192, 500000.0, None, c.device)
        pos = torch.randint(0, 8192, (num_tokens,), device=c.device)
        add("apply_rope_", f"{num_tokens} tokens",
            lambda: rope.apply_rope_triton_(q, k, pos, cos, sin),
            num_bytes=2 * (q.numel() + k.numel()) * elt + 2 * num_tokens * c.head_dim * 4)
        slots = torch.randperm(num_tokens * 2, device=c.device)[:num_tokens]
        kc, vc = (c.randn(num_tokens * 2 // BLOCK_SIZE + 1, BLOCK_SIZE, c.num_kv_heads,
                          c.head_dim) for _ in range(2))
        add("write_kv_cache_", f"{num_tokens} tokens",
            lambda: kv_cache_write.write_kv_cache_triton_(k, k, kc, vc, slots),
            num_bytes=4 * k.numel() * elt)
        add("rope_write_kv_", f"{num_tokens} tokens",
            lambda: rope_kv_write.rope_write_kv_triton_(q, k, k, pos, cos, sin, kc, vc, slots),
            num_bytes=(2 * q.numel() + 5 * k.numel()) * elt + 2 * num_tokens * c.head_dim * 4)

    num_sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    for batch in (1, 32, 128, 256):
        for context in (512, 2048):
            kc, vc, tables, lens = c.paged([context] * batch)
            q = c.randn(batch, c.num_heads, c.head_dim)
            policy = paged_decode_attention.num_decode_splits(
                batch, c.num_kv_heads, tables.shape[1] * BLOCK_SIZE, num_sms)
            # At batch 1 every split factor, to pick the small-batch policy from data.
            for splits in ((1, 2, 4, 8, 16, 32) if batch == 1 else (policy,)):
                mark = " (policy)" if splits == policy else ""
                add("paged_decode_attention", f"batch {batch} ctx {context} splits {splits}{mark}",
                    lambda splits=splits: paged_decode_attention.paged_decode_attention_triton(
                        q, kc, vc, tables, lens, c.head_dim ** -0.5, splits),
                    num_bytes=2 * batch * context * c.num_kv_heads * c.head_dim * elt)
            del kc, vc

    for num_seqs in (1, 8):
        kc, vc, tables, lens = c.paged([2048] * num_seqs)
        cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=c.device) * 2048
        q = c.randn(num_seqs * 2048, c.num_heads, c.head_dim)
        causal_pairs = num_seqs * 2048 * 2049 / 2
        add("prefill_attention", f"{num_seqs}x2048 (one layer)",
            lambda: prefill_attention.prefill_attention_triton(
                q, kc, vc, tables, cu, lens, c.head_dim ** -0.5, 2048),
            num_flops=4 * causal_pairs * c.num_heads * c.head_dim)
    return results
