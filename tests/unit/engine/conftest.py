"""Fixtures for the model tests: tiny random checkpoints written by transformers itself.

The checkpoints are the independent reference: transformers builds and saves them, our loader
reads them back, and transformers' own forward pass gives the logits we must match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# The init scale is well above the usual 0.02 so that logits have clear winners: with
# near-uniform logits a greedy comparison would test rounding noise, not the model.
_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, initializer_range=0.25, bos_token_id=1, eos_token_id=2)

VARIANTS: dict[str, dict] = {
    "llama_tied": dict(arch="llama", tie_word_embeddings=True, rope_theta=10000.0),
    "llama_untied": dict(arch="llama", tie_word_embeddings=False, rope_theta=50000.0),
    "llama_head_dim": dict(arch="llama", tie_word_embeddings=False, head_dim=24),
    "qwen2_bias": dict(arch="qwen2", tie_word_embeddings=False, rope_theta=1000000.0),
    "llama3_rope": dict(arch="llama", tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32)),
    "sharded": dict(arch="llama", tie_word_embeddings=False, shard="20KB"),
    # head_dim 24 != hidden / heads, as Qwen3 configs state it explicitly.
    "qwen3": dict(arch="qwen3", tie_word_embeddings=False, head_dim=24, rope_theta=1000000.0),
    # Sliding windows shorter than the test prompts: Mistral's on every layer, Qwen3's on
    # the layers from max_window_layers on (layer 1 here).
    "mistral_window": dict(arch="mistral", tie_word_embeddings=False, sliding_window=5),
    "qwen3_window": dict(arch="qwen3", tie_word_embeddings=False, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1),
    # Windows of 6 positions on layer 0, shorter than the test prompts and continuations;
    # a query scalar other than head_dim; soft-caps low enough to bite. Untied: tied to an
    # embedding scaled by sqrt(hidden), this random model repeats one token forever.
    "gemma2": dict(arch="gemma2", tie_word_embeddings=False, head_dim=16, rope_theta=10000.0, sliding_window=6, query_pre_attn_scalar=24,
                   attn_logit_softcapping=4.0, final_logit_softcapping=20.0),
    # Mixtures of 4 experts, 2 per token: Qwen3-MoE with every layer sparse and the picked
    # weights as the softmax left them; with layer 0 dense (decoder_sparse_step 2) and the
    # weights renormalised; Mixtral (always renormalised, w1/w2/w3 expert names) with
    # Mistral's window on every layer, shorter than the prompts.
    "qwen3_moe": dict(arch="qwen3_moe", tie_word_embeddings=False, head_dim=24,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False),
    "qwen3_moe_sparse_step": dict(arch="qwen3_moe", tie_word_embeddings=False, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=40,
                                  norm_topk_prob=True, decoder_sparse_step=2),
    "mixtral": dict(arch="mixtral", tie_word_embeddings=False, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=5),
    # Qwen2-MoE: q/k/v biases, a shared expert beside the routed ones, layer 0 dense.
    "qwen2_moe": dict(arch="qwen2_moe", tie_word_embeddings=False, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False,
                      mlp_only_layers=[0], rope_theta=1000000.0),
}
MOE_VARIANTS = ("qwen3_moe", "qwen3_moe_sparse_step", "mixtral", "qwen2_moe")


@dataclass(frozen=True)
class TinyModel:
    path: Path
    reference: torch.nn.Module  # the transformers model that wrote `path`, eval mode


def write_tiny_model(directory: Path, variant: str, seed: int = 0) -> TinyModel:
    import transformers

    spec = dict(VARIANTS[variant])
    arch, shard = spec.pop("arch"), spec.pop("shard", None)
    if "rope_theta" in spec:
        spec["rope_parameters"] = dict(rope_type="default", rope_theta=spec.pop("rope_theta"))
    name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
            "gemma2": "Gemma2", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
            "qwen2_moe": "Qwen2Moe"}[arch]
    config_cls = getattr(transformers, name + "Config")
    model_cls = getattr(transformers, name + "ForCausalLM")
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **spec})
    if variant in MOE_VARIANTS:
        # The plain attention the reference test compares against, whatever the default.
        config._attn_implementation = "eager"
    model = model_cls(config).eval()
    # Biases start at zero and norms at one (Gemma's at zero); give them values so a dropped
    # bias or norm cannot go unnoticed.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return TinyModel(path=directory, reference=model)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module: on a small shared machine torch's spinning
    OpenMP threads slow every step down several-fold when cores are oversubscribed."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """tiny_model(variant) -> a checkpoint of that variant, written once per session."""
    cache: dict[str, TinyModel] = {}

    def get(variant: str) -> TinyModel:
        if variant not in cache:
            cache[variant] = write_tiny_model(tmp_path_factory.mktemp(variant), variant)
        return cache[variant]

    return get


class Stepper:
    """Drives a ModelRunner the way the scheduler does: one ScheduleOutput per step."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        from engine.kv_storage import KVStorage
        from engine.model_runner import ModelRunner

        dtype = next(model.parameters()).dtype
        self.kv = KVStorage.for_model(model.config, num_blocks, block_size, dtype)
        self.runner = ModelRunner(model, self.kv, block_size)

    def step(self, *chunks: tuple) -> torch.Tensor:
        """Each chunk is (request_id, token_ids, start_pos, block_ids, sample)."""
        from engine.schedule_output import ScheduledChunk, ScheduleOutput

        return self.runner.execute(ScheduleOutput(tuple(
            ScheduledChunk(rid, tuple(ids), start, tuple(blocks), sample)
            for rid, ids, start, blocks, sample in chunks)))

    def greedy(self, prompt: list[int], num_tokens: int, block_ids: list[int],
               request_id: str = "r") -> list[int]:
        """Prefill the prompt in one chunk, then decode one token per step."""
        logits = self.step((request_id, prompt, 0, block_ids, True))
        seq, out = list(prompt), []
        for _ in range(num_tokens):
            token = int(logits[0].argmax())
            out.append(token)
            seq.append(token)
            if len(out) < num_tokens:
                logits = self.step((request_id, [token], len(seq) - 1, block_ids, True))
        return out


@pytest.fixture
def stepper() -> Callable[..., Stepper]:
    """stepper(model, num_blocks=64, block_size=4) -> a runner over a fresh KV pool."""

    def make(model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4) -> Stepper:
        return Stepper(model, num_blocks, block_size)

    return make
